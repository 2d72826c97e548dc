"""Know before you rent: a run's GPU memory planned on any machine (planner), from a trace of its
real step over fake tensors (memory), Inductor's lowering of a compiled step (compiled), and what a
GPU adds (gpus: cards, the CUDA context, kernels' scratch); the micro-batch that fits a card and the
--plan command (fit)."""
