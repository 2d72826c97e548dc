"""fastpt.train's command line: one flag per TrainConfig field, with its help, choices and range."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from fastpt.checkpoint import saved_config
from fastpt.config import AUTO, CPU_PROFILE, FIELD_TYPES, FIELDS, load_toml, recipe_values, resume_implied
from fastpt.errors import ArgumentParser, ConfigError, elsewhere, suggest
from fastpt.presets import describe_presets, upgraded_run

# A run's config.toml keys that say where and how it ran this time, never what it is.
NOT_RESUMED = ("out", "resume", "resume_require", "resume_or_start", "threads", "device", "plan", "plan_json")


def int_or_auto(text: str) -> int | str:
    return text if text == AUTO else int(text)


def spelled_out(argv: list[str]) -> list[str]:
    """argv with `--resume=require` as the two flags it means, --resume --resume-require."""
    return [flag for arg in argv for flag in (["--resume", "--resume-require"] if arg == "--resume=require" else [arg])]


def parse_args(argv: list[str] | None) -> tuple[dict, str | None]:
    """Only flags the user actually gave are returned, so the TOML file and defaults can fill in."""
    ap = ArgumentParser(
        prog="python -m fastpt.train",
        description="Pretrain a Llama-style model.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="presets:\n" + describe_presets() + "\n\nOn a CPU the defaults become a short "
        "tiny-preset run: " + ", ".join(f"{k}={v}" for k, v in CPU_PROFILE.items()),
    )
    ap.add_argument("--config", help="TOML file with the same keys (underscores); flags win over it")
    ap.add_argument(
        "--list-presets",
        action="version",
        version=describe_presets(),
        help="print each preset's shape and size, then exit",
    )
    flags = ["--config", "--list-presets"]
    for name, f in FIELDS.items():
        flag = "--" + name.replace("_", "-")
        flags.append(flag)
        meta = f.metadata
        allowed = (
            f"; one of {', '.join(map(repr, meta['choices']))}"
            if meta["choices"]
            else f"; {meta['domain']}"
            if meta["domain"]
            else ""
        )
        default = "" if "the preset's by default" in meta["help"] else f" (default: {f.default!r})"
        help_text = f"{meta['help']}{allowed}{default}".replace("%", "%%")
        if FIELD_TYPES[name] is bool:
            ap.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_text)
        else:
            kind = int_or_auto if name == "micro_batch" else FIELD_TYPES[name]
            ap.add_argument(flag, type=kind, default=argparse.SUPPRESS, help=help_text, metavar=name.upper())
    args, unknown = ap.parse_known_args(spelled_out(sys.argv[1:] if argv is None else argv))
    if unknown:
        flag = unknown[0].split("=")[0]
        hint = elsewhere(flag) or suggest(flag, flags)
        raise ConfigError(f"command line: unrecognized argument '{unknown[0]}'{hint}")
    args = vars(args)
    return args, args.pop("config", None)


def resumed_run(cli: dict[str, Any], config_file: str | None, device: str) -> dict[str, Any]:
    """With --resume and an --out that holds a run's config.toml: its values, the base that --config
    and flags change (config.resolve's `run`); else {}. Under another --recipe than the run's, the
    keys either recipe sets are left to the new one (a changed shape is then refused, naming it)."""
    given = {**resume_implied(load_toml(config_file) if config_file else {}), **resume_implied(cli)}
    out = given.get("out") or (CPU_PROFILE["out"] if device == "cpu" else FIELDS["out"].default)
    if not given.get("resume") or not (run := run_config(Path(out))):
        return {}
    recipe = given.get("recipe", run.get("recipe", "seed"))
    if recipe != run.get("recipe", "seed"):
        for key in {*recipe_values(run.get("recipe", "seed")), *recipe_values(recipe)}:
            run.pop(key, None)
    if run.get("warmup_steps", 0) > given.get("max_steps", run.get("max_steps", 0)):
        del run["warmup_steps"]  # a shorter run than the warmup: the default warmup adapts to it (resolve)
    return {k: v for k, v in run.items() if k not in NOT_RESUMED}


def run_config(out: Path) -> dict[str, Any]:
    """A run folder's config.toml, with the keys it lacks (a file cut at a line end, none, or one
    that does not parse) taken from the newest checkpoint's train_config, and said, in this fastpt's
    terms (presets.upgraded_run); {} for a folder with neither."""
    path = out / "config.toml"
    toml, whole, error = {}, "is missing", None
    if path.is_file():
        try:
            toml = load_toml(str(path))
        except ConfigError as e:
            whole, error = f"is unreadable ({e})", e
    # Only this run's checkpoints fill in: another run's, copied in, would make this run its model. A
    # config.toml with a run id was written whole up to it: a shape key it leaves out is the preset's.
    run_id = toml.get("run_id", "") if toml else None
    saved = {
        k: v
        for k, v in saved_config(out, "train_config", run_id).items()
        if k in FIELDS
        and k not in NOT_RESUMED
        and v is not None  # to_toml leaves out None (a preset's shape)
        and not (run_id and FIELDS[k].default is None)
    }
    if error and not saved:
        raise error
    if lost := [k for k in saved if k not in toml]:
        what = f"lacks {', '.join(lost)}" if toml else whole
        print(f"fastpt: warning: {path} {what}: the checkpoint's values apply", file=sys.stderr, flush=True)
    return upgraded_run({**saved, **toml}, saved_config(out, "model_config"))
