"""``mindtrain-convert-config OLD NEW [--style mindformers|hf]``: rewrite a legacy static-graph
MindFormers config into the eager form, and/or write the model section in one naming style."""

from __future__ import annotations

import argparse
import dataclasses
import sys

import yaml

from mindtrain.config.errors import UserError
from mindtrain.config.legacy import convert_legacy, legacy_problems
from mindtrain.config.loader import parse_config, read_yaml
from mindtrain.config.model_names import to_canonical, to_mindformers
from mindtrain.config.schema import MindTrainConfig


def restyle(raw: dict, style: str) -> dict:
    """``raw`` with its model section in ``style``: "hf" (mindtrain's names), "mindformers"
    (MindFormers' names) or "keep" (as written)."""
    model = raw.get("model")
    if style == "keep" or not isinstance(model, dict):
        return raw
    canonical = to_canonical(model)
    if style == "hf":
        canonical = {k: v for k, v in canonical.items() if v is not None}
    return {**raw, "model": to_mindformers(canonical) if style == "mindformers" else canonical}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mindtrain-convert-config", description=__doc__)
    parser.add_argument("old", help="legacy static-graph YAML, or an eager config to restyle")
    parser.add_argument("new", help="where to write the eager config")
    parser.add_argument("--style", choices=("keep", "mindformers", "hf"), default="keep",
                        help="naming style of the model section: MindFormers' names, HF DeepSeek-V3 names, "
                             "or as written (default)")
    args = parser.parse_args(argv)
    notes: list[str] = []
    try:
        raw = read_yaml(args.old)
        if legacy_problems(raw):
            defaults = MindTrainConfig()
            fields = {f.name: {g.name for g in dataclasses.fields(getattr(defaults, f.name))}
                      for f in dataclasses.fields(MindTrainConfig)
                      if dataclasses.is_dataclass(getattr(defaults, f.name))}
            raw, notes = convert_legacy(raw, fields)
        elif args.style == "keep":
            print(f"{args.old}: already in the eager form; nothing to convert (use --style to rename the "
                  "model fields)", file=sys.stderr)
        new = restyle(raw, args.style)
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
