"""What a server chooses at warm-up, start after start: `python -m tools.bench.warm_up_choices
[--base DIR] [--classes 10,10000] [--starts 8] [--out FILE]`.

The softmax pass and the one-thread backbone range are chosen from timings at warm-up. A choice
that changes from one start to the next makes replicas of one deployment differ (and a before /
after comparison compare configurations). Each start is alone on the machine; with --base, the
other checkout's server is started in turn with this one's.
"""
from __future__ import annotations

import argparse
import tempfile
from collections import Counter
from pathlib import Path

from tools.bench.ab import check_checkout, checkout_server, describe, warm_up_choices
from tools.bench.run import cached_bundle
from tools.report import md_table, write_text

HERE = Path(__file__).resolve().parents[2]


def count_choices(trees: dict, classes: list[int], starts: int, dim: int = 256) -> dict:
    """{label: {D: Counter of (softmax_impl, one_thread_backbone_max_batch)}} over `starts` starts."""
    out = {label: {D: Counter() for D in classes} for label in trees}
    with tempfile.TemporaryDirectory(prefix="slc-choices-") as tmp:
        for D in classes:
            bundle = cached_bundle(D, dim)
            for i in range(starts):
                for label, tree in trees.items():
                    srv = checkout_server(tree, bundle, Path(tmp), f"{label}-{D}-{i}", grpc=False)
                    try:
                        srv.wait_ready(600)
                        c = warm_up_choices(srv)
                    finally:
                        srv.stop()
                    out[label][D][(c["softmax_impl"], c["one_thread_backbone_max_batch"])] += 1
    return out


def choices_markdown(counts: dict, trees: dict, starts: int, command: str) -> str:
    rows = [[label, f"{D:,}", ", ".join(f"{impl} / {small}: {n}" for (impl, small), n in c.most_common())]
            for label, by_d in counts.items() for D, c in by_d.items()]
    return "\n".join([
        "# Warm-up choices, start after start", "", f"Command: `{command}`  ",
        "Checkouts: " + "; ".join(f"{label} `{tree}` at {describe(tree)}" for label, tree in trees.items()) + ".  ",
        f"{starts} starts per checkout and D, each server alone, checkouts in turn; per start `GET /v1/model`: "
        "softmax_impl / one_thread_backbone_max_batch.", "",
        md_table(["checkout", "D", "choices (count)"], rows, "lrl"), ""])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", type=Path, help="another checkout, started in turn with this one")
    ap.add_argument("--classes", default="10,10000")
    ap.add_argument("--starts", type=int, default=8)
    ap.add_argument("--out", type=Path, help="write the markdown here too")
    args = ap.parse_args()
    trees = {"head": HERE} | ({"base": check_checkout(args.base)} if args.base else {})
    classes = [int(c) for c in args.classes.split(",")]
    counts = count_choices(trees, classes, args.starts)
    command = (f"python -m tools.bench.warm_up_choices --classes {args.classes} --starts {args.starts}"
               + (f" --base {args.base}" if args.base else ""))
    md = choices_markdown(counts, trees, args.starts, command)
    print(md)
    if args.out:
        write_text(args.out, md)


if __name__ == "__main__":
    main()
