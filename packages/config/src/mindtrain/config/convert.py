"""``mindtrain-convert-config OLD NEW``: rewrite a legacy static-graph config into the flat form."""

from __future__ import annotations

import argparse
import dataclasses
import sys

import yaml

from mindtrain.config.errors import UserError
from mindtrain.config.legacy import convert_legacy, legacy_problems
from mindtrain.config.loader import parse_config, read_yaml
from mindtrain.config.schema import MindTrainConfig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mindtrain-convert-config", description=__doc__)
    parser.add_argument("old", help="legacy YAML config")
    parser.add_argument("new", help="where to write the flat eager config")
    args = parser.parse_args(argv)
    try:
        raw = read_yaml(args.old)
        if not legacy_problems(raw):
            print(f"{args.old}: already in the flat eager form; nothing to convert", file=sys.stderr)
        defaults = MindTrainConfig()
        fields = {f.name: {g.name for g in dataclasses.fields(getattr(defaults, f.name))}
                  for f in dataclasses.fields(MindTrainConfig)
                  if dataclasses.is_dataclass(getattr(defaults, f.name))}
        new, notes = convert_legacy(raw, fields)
        parse_config(new, validate=True)  # the result must load and validate
        with open(args.new, "w", encoding="utf-8") as f:
            yaml.safe_dump(new, f, sort_keys=False, allow_unicode=True)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"error: cannot write '{args.new}': {err.strerror}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"  {note}")
    print(f"wrote {args.new}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
