"""``python -m examples {sft,grpo} [options]``: dispatch to a demo's ``main(argv)``."""

from __future__ import annotations

import argparse
import importlib
import sys

# Demo name -> module with ``main(argv: list[str]) -> int | None``.  Imported only when chosen:
# each pulls in transformers (and grpo also trl), which take seconds to import.
DEMOS = {
    "sft": "examples.sft",
    "grpo": "examples.grpo",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="python -m examples",
        description="hf_fused demos; options after the demo name go to it (try `sft --help`).",
    )
    parser.add_argument("demo", choices=sorted(DEMOS))
    parser.add_argument("args", nargs=argparse.REMAINDER, help="options of the demo")
    ns = parser.parse_args(argv[:1])  # parse the name only: `sft --help` is the demo's help
    try:
        module = importlib.import_module(DEMOS[ns.demo])
    except ModuleNotFoundError as e:
        if e.name != DEMOS[ns.demo]:
            raise  # a dependency of the demo is missing: keep the real error
        parser.error(f"the {ns.demo!r} demo ({DEMOS[ns.demo]}) is not available in this install")
    status = module.main(argv[1:])
    return int(status or 0)


if __name__ == "__main__":
    sys.exit(main())
