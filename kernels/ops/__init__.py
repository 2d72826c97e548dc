"""Raw Triton kernels and their launchers. Imported lazily: triton.jit reads TRITON_INTERPRET
when a kernel is decorated, so these modules must be imported after that variable is set."""
