"""Run a Megatron-LM training script with SAP hooks installed.

    python -m megatron_sap.launch /path/to/Megatron-LM/pretrain_gpt.py <Megatron flags> \\
        --context-parallel-size 8 --cp-comm-type sap --sap-inner-size 4 ...

The script's directory (the Megatron-LM checkout, whose `gpt_builders`/`model_provider`
modules the script imports) and `$MEGATRON_LM_PATH` when set go first on sys.path; the hooks of
`megatron_sap.megatron.hooks` are installed; the script then runs as `__main__` with the
remaining arguments as its argv. Works under torchrun and srun like the script itself.
"""
from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

USAGE = "usage: python -m megatron_sap.launch <megatron-lm>/pretrain_gpt.py [megatron flags ...]"


def main(argv: list[str]) -> None:
    """Install the hooks and run `argv[0]` with `argv[1:]` as its arguments."""
    if not argv:
        raise SystemExit(USAGE)
    if argv[0] in ("-h", "--help"):
        print(USAGE)
        raise SystemExit(0)
    script = Path(argv[0]).resolve()
    if not script.is_file():
        why = "is a directory, not a training script" if script.is_dir() else "not found"
        if argv[0].startswith("/pretrain") and not os.environ.get("MEGATRON_LM_PATH"):
            why += " (MEGATRON_LM_PATH is not set: `$MEGATRON_LM_PATH/pretrain_gpt.py` read as `/pretrain_gpt.py`)"
        raise SystemExit(f"training script {argv[0]!r} {why}\n{USAGE}")
    if any(arg in ("-h", "--help") for arg in argv[1:]):
        print_sap_flags()  # Megatron-LM's own --help, which the script prints next, parses without them
    roots = [str(script.parent)]
    if os.environ.get("MEGATRON_LM_PATH"):
        roots.insert(0, str(Path(os.environ["MEGATRON_LM_PATH"]).resolve()))
    for root in reversed(roots):
        if root in sys.path:  # first, even if PYTHONPATH has it further back
            sys.path.remove(root)
        sys.path.insert(0, root)

    from megatron_sap.megatron.hooks import install_training_hooks

    try:
        install_training_hooks()
    except ImportError as err:
        raise SystemExit(
            f"cannot install the SAP hooks: {err}. The launcher patches Megatron-LM's `megatron.training`, which "
            f"comes with a Megatron-LM checkout (not with the megatron-core package): run a script inside the "
            f"checkout, or set MEGATRON_LM_PATH to it"
        ) from err
    except RuntimeError as err:  # a Megatron-LM release whose training code the hooks do not follow
        raise SystemExit(f"cannot install the SAP hooks: {err}") from err
    sys.argv = [str(script), *argv[1:]]
    runpy.run_path(str(script), run_name="__main__")


def print_sap_flags() -> None:
    """The `--sap-*` flags the launcher adds (`add_sap_args`): `pretrain_gpt.py --help` lists
    Megatron-LM's own flags only, as its first parse has no extra provider (docs/megatron.md)."""
    import argparse

    from megatron_sap.megatron.arguments import add_sap_args

    parser = add_sap_args(argparse.ArgumentParser(prog="python -m megatron_sap.launch <script>", add_help=False,
                                                  usage=argparse.SUPPRESS))
    print("SAP flags, which the launcher adds (Megatron-LM's own follow):")
    print(parser.format_help())
    sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
