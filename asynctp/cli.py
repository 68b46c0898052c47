"""`asynctp doctor | bench | demo`: the command line."""

from __future__ import annotations

import argparse
import importlib
import sys

__all__ = ["main"]

# subcommand -> (module with add_arguments(parser) and run(args) -> int, help)
_COMMANDS = {
    "doctor": ("asynctp.doctor", "what this machine offers: GPUs, peer access, backends, versions"),
    "bench": ("asynctp.bench.cli", "time the fused ops against their bounds, serial and torch's own"),
    "demo": ("asynctp.demo.cli", "train a Llama-style model with vanilla TP and asynctp side by side"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="asynctp", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name, (module_name, help_text) in _COMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name is None or not module_name.startswith(exc.name):
                raise
            modules[name] = None
            continue
        modules[name] = module
        module.add_arguments(sub_parser)
    args = parser.parse_args(argv)
    module = modules[args.command]
    if module is None:
        print(f"asynctp {args.command}: not yet available in this version", file=sys.stderr)
        return 2
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
