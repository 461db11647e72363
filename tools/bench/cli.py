"""`slc bench scale`, `routes`, `index` and the others (the trainer's `slc bench losses` lives in trainer/cli.py)."""
from __future__ import annotations

import json
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import click

from serving.bundle.cliopts import OUT, POSITIVE, bundle_dir as existing_bundle, guarded, key_values, require
from tools import require as require_lab
from tools.report import write_json, write_result


@contextmanager
def _served(bundle: Path, tag: str, grpc: bool = False) -> Iterator[tuple]:
    """(`slc serve BUNDLE` ready on a free port, its scratch directory), stopped after."""
    from tools.bench.server import slc_server

    with tempfile.TemporaryDirectory(prefix=f"slc-{tag}-") as tmp:
        with slc_server(bundle, Path(tmp), tag, Path(tmp) / "data", grpc=grpc) as srv:
            srv.wait_ready(300)
            yield srv, Path(tmp)


def _classes(ctx: click.Context, param: click.Parameter, value: str) -> list[int]:
    try:
        classes = sorted({int(c) for c in value.split(",") if c.strip()})
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {value!r}", ctx, param) from None
    if not classes or classes[0] < 2:
        raise click.BadParameter(f"every D must be >= 2, got {value!r}", ctx, param)
    return classes


@click.command()
@click.option("--classes", default="10,1000,100000,1000000", show_default=True, callback=_classes, help="comma list of D")
@click.option("--dim", type=click.IntRange(min=1), default=256, show_default=True, help="embedding size d")
@click.option("--duration", type=POSITIVE, default=8.0, show_default=True, help="measured seconds per endpoint and D")
@click.option("--concurrency", type=click.IntRange(min=1), default=8, show_default=True, help="closed-loop workers")
@click.option("--peer/--no-peer", default=True, show_default=True, help="also measure the plain torch peer (train extra)")
@click.option("--default-model/--no-default-model", default=True, show_default=True,
              help="also measure detect on the default model")
@click.option("--bundle", "bundle_dir", type=click.Path(path_type=Path), callback=existing_bundle,
              help="measure this one bundle (e.g. a trained model) instead of the synthetic sweep")
@click.option("--out", default="docs/results", show_default=True, help="where scale.{json,md,png} go", **OUT)
@guarded("report folder", inputs=('bundle_dir',))
def scale(classes: list[int], dim: int, duration: float, concurrency: int, peer: bool, default_model: bool,
          bundle_dir: Optional[Path], out: Path) -> None:
    """Single-logit vs full softmax as D grows: OUT/scale.{json,md,png}; or on one real bundle."""
    if bundle_dir is not None:
        from tools.bench.bundle_scale import bench_bundle, bundle_markdown

        r = bench_bundle(bundle_dir, duration, concurrency)
        command = f"slc bench scale --bundle {bundle_dir} --duration {duration:g} --concurrency {concurrency}"
        write_result(out, f"scale-{r['bundle']}", lambda: bundle_markdown(r, command), r, default=str)
        click.echo(f"{r['bundle']}: detect/softmax throughput {r['ratios']['detect_over_softmax_rps']:.2f}x "
                   f"-> {out / ('scale-' + r['bundle'] + '.md')}")
        return
    from tools.bench.report import scale_markdown
    from tools.bench.run import run_scale_bench

    require_lab("matplotlib")  # scale.png, written after the sweep
    res = run_scale_bench(classes=classes, dim=dim, duration=duration, out=out, concurrency=concurrency,
                          with_peer=peer, default_model=default_model)
    click.echo(scale_markdown(res))
    missed = [t["target"] for t in res["targets"] if t["met"] is False]
    click.echo(f"{len(res['rows'])} sizes in {res['elapsed_s']:.0f} s -> {out / 'scale.md'}; "
               f"targets met {sum(t['met'] is True for t in res['targets'])}/{len(res['targets'])}"
               + (f"; missed: {'; '.join(missed)}" if missed else ""))


@click.command()
@click.option("--classes", type=click.IntRange(min=2), default=100_000, show_default=True, help="rows of the synthetic head")
@click.option("--dim", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--rows", type=click.Choice(["gaussian", "clustered"]), default="gaussian", show_default=True)
@click.option("--kind", type=click.Choice(["exact", "flat", "ivf", "hnsw"]), help="[default: the server's choice for this D]")
@click.option("--param", "params", multiple=True, callback=key_values,
              help="k=v build parameter (nlist, nprobe, codes=none|sq4|sq8|flat, rerank, ...), repeatable")
@click.option("--batch", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--work", default=str(Path(tempfile.gettempdir()) / "slc-index-bench"), show_default="$TMPDIR/slc-index-bench",
              help="where the head and the index cache are kept between runs", **OUT)
@click.option("--bundle", "bundle_dir", type=click.Path(path_type=Path), callback=existing_bundle,
              help="measure on this bundle's trained head with real queries instead of a synthetic head")
@click.option("--inputs", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="with --bundle: a .npy of raw inputs to embed as queries [default: the bundle's samples]")
@click.option("--grow", default="", help="with --bundle: comma list of head sizes grown by perturbed copies of the rows")
@click.option("--sigma", type=POSITIVE, default=0.3, show_default=True, help="with --bundle: perturbation of the copies")
@click.option("--out", default="docs/results", show_default=True, help="with --bundle: where the report goes", **OUT)
@guarded("report folder", inputs=('bundle_dir', 'inputs',))
def index(classes: int, dim: int, rows: str, kind: Optional[str], params: dict, batch: int, work: Path,
          bundle_dir: Optional[Path], inputs: Optional[Path], grow: str, sigma: float, out: Path) -> None:
    """Build time, memory, recall@10 and speed-up vs exact of the top-k index on a synthetic head
    (the first run writes the head; run again for memory figures that exclude writing it), or with
    --bundle on a trained head and real queries."""
    if bundle_dir is not None:
        return _trained_index(bundle_dir, inputs, grow, sigma, kind, work, out)
    from tools.bench.index import run_index_bench

    report = run_index_bench(classes, dim, rows, work, kind=kind, params=params, batch=batch)
    click.echo(json.dumps(report, indent=1))
    click.echo(f"{report['info'].get('kind')} index over {classes:,} rows: open {report['open_seconds']} s, "
               f"recall@10 {report['near_row']['recall_at_10']} (near-row queries), "
               f"{report['near_row']['speedup_batch']}x exact per batch")


@click.command()
@click.option("--duration", type=POSITIVE, default=60.0, show_default=True, help="seconds of load in all")
@click.option("--kills", type=click.IntRange(min=1), default=3, show_default=True, help="kill -9 rounds in the first half")
@click.option("--classes", type=click.IntRange(min=2), default=1000, show_default=True, help="D of the synthetic bundle")
@click.option("--concurrency", type=click.IntRange(min=1), default=4, show_default=True, help="load client workers")
@click.option("--out", default="docs/results", show_default=True, help="where soak.{json,md} go", **OUT)
@guarded("report folder")
def soak(duration: float, kills: int, classes: int, concurrency: int, out: Path) -> None:
    """Mixed load with kill -9 of the server during gallery writes: acknowledged writes lost (must be 0),
    memory growth, open descriptors, errors. Exit 1 if an acknowledged write was lost."""
    import sys

    from tools.bench.run import INPUT_DIM, cached_bundle
    from tools.bench.soak import run_soak, soak_markdown

    bundle = cached_bundle(classes, 64)
    with tempfile.TemporaryDirectory(prefix="slc-soak-") as tmp:
        res = run_soak(bundle, INPUT_DIM, Path(tmp), duration, kills, concurrency, [sys.executable, "-m", "slc"])
    command = f"slc bench soak --duration {duration:g} --kills {kills} --classes {classes} --concurrency {concurrency}"
    write_result(out, "soak", lambda: soak_markdown(res, command), res)
    w = res["writes"]
    click.echo(f"soak: {w['acknowledged']} acknowledged writes, {w['lost_at_end']} lost; memory "
               f"{res['memory']['growth_bytes'] / 2**20:+.1f} MiB after warm-up; fds {res['fds']['after_warmup']} -> "
               f"{res['fds']['end']} -> {out / 'soak.md'}")
    if w["lost_at_end"]:
        raise click.ClickException(f"{w['lost_at_end']} acknowledged writes were lost")


@click.command()
@click.option("--max-examples", type=click.IntRange(min=1), default=100, show_default=True,
              help="examples per operation and phase")
@click.option("--seed", type=int, default=1, show_default=True)
@click.option("--classes", type=click.IntRange(min=2), default=50, show_default=True, help="D of the synthetic bundle")
@click.option("--out", default="docs/results", show_default=True, help="where fuzz.{json,md} go", **OUT)
@guarded("report folder")
def fuzz(max_examples: int, seed: int, classes: int, out: Path) -> None:
    """schemathesis against a real server from its own OpenAPI: 0 server errors, 0 responses off
    their schema, 0 undocumented statuses. Exit 1 otherwise."""
    from tools.bench.fuzz import fuzz_markdown, run_fuzz
    from tools.bench.run import cached_bundle

    require_lab("schemathesis")
    with _served(cached_bundle(classes, 16), "fuzz") as (srv, tmp):
        res = run_fuzz(srv.url, max_examples, seed, tmp)
    command = f"slc bench fuzz --max-examples {max_examples} --seed {seed} --classes {classes}"
    write_result(out, "fuzz", lambda: fuzz_markdown(res, command), res)
    v = res["verdict"]
    click.echo(f"fuzz: {res['test_cases']['generated']} requests over {res['operations']['tested']} operations; "
               + ", ".join(f"{n} {name}" for name, n in v.items()) + f" -> {out / 'fuzz.md'}")
    if not res["passed"]:
        raise click.ClickException("the server failed the fuzz verdict; see " + str(out / "fuzz.md"))


@click.command()
@click.option("--size-mb", type=click.FloatRange(min=0.01, max=8.0), default=7.5, show_default=True,
              help="body size (the server's limit is 8 MiB)")
@click.option("--out", default="docs/results", show_default=True, help="where hostile.{json,md} go", **OUT)
@guarded("report folder")
def hostile(size_mb: float, out: Path) -> None:
    """Hostile bodies (strings, objects, nesting, counts, huge examples) against a real server: time
    to answer, peak-memory growth, and a concurrent health probe's worst latency; then hostile images
    (scan bomb, chunk flood, 16-bit PNG), several at once, against a server of an image bundle: also
    a valid image's latency during the attack and the RSS of the server and its decode processes."""
    from tools.bench.hostile import KINDS, hostile_markdown, measure
    from tools.bench.run import INPUT_DIM, cached_bundle

    from tools.bench.hostile_service import service_markdown, service_rows
    from tools.bench.server import grpc_available

    with _served(cached_bundle(1000, 64), "hostile", grpc=grpc_available()) as (srv, tmp):
        rows = [measure(srv, kind, int(size_mb * (1 << 20)), INPUT_DIM) for kind in KINDS]
        service = service_rows(srv, tmp / "data", INPUT_DIM)  # gallery and gRPC attacks
    from tools.bench.hostile_images import image_markdown, image_rows

    with tempfile.TemporaryDirectory(prefix="slc-hostile-images-") as tmp:
        images = image_rows(Path(tmp))
    write_json(out / "hostile-images.json", images)
    write_json(out / "hostile-service.json", service)
    md, _ = write_result(out, "hostile", lambda: hostile_markdown(rows, f"slc bench hostile --size-mb {size_mb:g}") + "\n"
                         + image_markdown(images, "slc bench hostile") + service_markdown(service), rows)
    click.echo(md.read_text())
    worst = max(rows, key=lambda r: r["seconds"])
    click.echo(f"{len(rows)} hostile bodies: slowest answer {worst['seconds']:.3f} s ({worst['kind']}), worst probe "
               f"{max(r['worst_probe_ms'] for r in rows):.1f} ms -> {out / 'hostile.md'}")


@click.command()
@click.option("--gallery-url", required=True, help="postgresql://… (a database the benchmark may write to)")
@click.option("--items", type=click.IntRange(min=1), default=200, show_default=True)
@click.option("--out", default="docs/results", show_default=True, **OUT)
@guarded("report folder")
def gallery(gallery_url: str, items: int, out: Path) -> None:
    """Shared gallery: delay until another replica sees a write or delete, and the write rate."""
    from tools.bench.gallery_sync import markdown, measure

    require("psycopg", "postgres")
    result = measure(gallery_url, items)
    command = f"slc bench gallery --gallery-url postgresql://… --items {items}"
    write_result(out, "shared-gallery", lambda: markdown(result, command), result)
    up = result["upsert"]
    click.echo(f"gallery: upsert seen by the other replica after p50 {up['p50_ms']:.1f} ms, p99 {up['p99_ms']:.1f} ms; "
               f"{result['writes_per_s']:.0f} writes/s -> {out / 'shared-gallery.md'}")


def _trained_index(bundle_dir: Path, inputs: Optional[Path], grow: str, sigma: float, kind: Optional[str],
                   work: Path, out: Path) -> None:
    from tools.bench.trained_index import markdown, run

    sizes = [int(g) for g in grow.split(",") if g.strip()]
    kinds = (kind,) if kind else ("ivf", "hnsw")
    result = run(bundle_dir, inputs, sizes, sigma, kinds, work)
    command = (f"slc bench index --bundle {bundle_dir}" + (f" --inputs {inputs}" if inputs else "")
               + (f" --grow {grow}" if grow else "") + f" --sigma {sigma:g}" + (f" --kind {kind}" if kind else ""))
    name = f"index-trained-{result['bundle']}"
    write_result(out, name, lambda: markdown(result, command), result)
    worst = min(result["rows"], key=lambda r: r["recall_at_10"])
    click.echo(f"index on {result['bundle']}: {len(result['rows'])} head x kind rows, lowest recall@10 "
               f"{worst['recall_at_10']:.3f} ({worst['kind']}, {worst['classes']:,} classes) -> {out / name}.md")


@click.command()
@click.argument("bundle_dir", metavar="BUNDLE", type=click.Path(path_type=Path), callback=existing_bundle)
@click.option("--inputs", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help=".npy of the split's raw inputs (the one export measured: the run's test split)")
@click.option("--labels", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help=".npy of their class ids")
@click.option("--classes", type=click.IntRange(min=1), default=50, show_default=True,
              help="classes whose detect answers are compared one by one")
@click.option("--out", default="docs/results", show_default=True, **OUT)
@guarded("report folder", inputs=('bundle_dir', 'inputs', 'labels',))
def agreement(bundle_dir: Path, inputs: Path, labels: Path, classes: int, out: Path) -> None:
    """Top-1 and per-class detect precision/recall over HTTP against the offline figures of export."""
    import numpy as np

    from tools.bench.agreement import markdown, measure

    x, y = np.load(inputs, mmap_mode="r"), np.load(labels)
    if len(x) != len(y):
        raise click.BadParameter(f"{len(x)} inputs but {len(y)} labels", param_hint="--labels")
    r = measure(bundle_dir, x, y, classes)
    command = f"slc bench agreement BUNDLE --inputs {inputs.name} --labels {labels.name} --classes {classes}"
    write_result(out, f"agreement-{r['bundle']}", lambda: markdown(r, command), r)
    click.echo(f"{r['bundle']}: HTTP top-1 {r['http_accuracy']:.4f} (offline {r['offline_accuracy']}); detect equal on "
               f"{r['classes_equal']}/{r['classes_clear']} classes -> {out / ('agreement-' + r['bundle'] + '.md')}")


@click.command()
@click.option("--bundle", "bundle_dir", type=click.Path(path_type=Path), callback=existing_bundle,
              help="[default: the synthetic D = 10 bundle of `slc bench scale`, 64-value inputs]")
@click.option("--default-model", is_flag=True, help="the embedded default model instead (784-value inputs)")
@click.option("--rounds", type=click.IntRange(min=1), default=5, show_default=True, help="rounds over the routes")
@click.option("--requests", type=click.IntRange(min=1), default=2000, show_default=True, help="requests per route and round")
@click.option("--out", default="docs/results", show_default=True,
              help="where routes.{json,md} go (routes-default-model.*, routes-BUNDLE.*)", **OUT)
@guarded("report folder", inputs=('bundle_dir',))
def routes(bundle_dir: Optional[Path], default_model: bool, rounds: int, requests: int, out: Path) -> None:
    """Server time per request on each route (live, detect, v2 JSON and binary, softmax), the app called
    in-process one request at a time: route against route without HTTP or load-client noise."""
    from rich.progress import Progress

    from tools.bench.routes import ROUTES, measure_routes, routes_markdown
    from tools.bench.run import cached_bundle

    if bundle_dir is not None and default_model:
        raise click.UsageError("give --bundle or --default-model, not both")
    if default_model:
        from serving.bundle import slc_home
        from serving.default_model import ensure_default_bundle

        bundle, stem, flag = ensure_default_bundle(slc_home()), "routes-default-model", " --default-model"
    elif bundle_dir is not None:
        bundle, stem, flag = bundle_dir, f"routes-{bundle_dir.name}", f" --bundle {bundle_dir}"
    else:
        bundle, stem, flag = cached_bundle(10, 256), "routes", ""
    with Progress(transient=True) as bar:
        task = bar.add_task("routes", total=rounds * len(ROUTES))
        r = measure_routes(bundle, ROUTES, rounds, requests, progress=lambda: bar.advance(task))
    command = f"slc bench routes{flag} --rounds {rounds} --requests {requests}"
    write_result(out, stem, lambda: routes_markdown(r, command), {**r, "command": command})
    best = r["best_us"]
    click.echo(routes_markdown(r, command))
    click.echo(f"detect {best['detect']:.0f} µs, v2 JSON {best['v2']:.0f} µs ({best['v2'] / best['detect']:.2f}×), "
               f"v2 binary {best['v2_binary']:.0f} µs per request -> {out / (stem + '.md')}")


@click.command()
@click.option("--classes", type=click.IntRange(min=2), default=100_000, show_default=True, help="D of the synthetic bundle")
@click.option("--dim", type=click.IntRange(min=1), default=256, show_default=True, help="embedding size d")
@click.option("--softmax-concurrency", type=click.IntRange(min=1), default=16, show_default=True,
              help="connections asking the full softmax meanwhile")
@click.option("--duration", type=POSITIVE, default=5.0, show_default=True, help="measured seconds per phase")
@click.option("--rounds", type=click.IntRange(min=1), default=2, show_default=True, help="alternations of the two servers")
@click.option("--out", default="docs/results", show_default=True, help="where mixed.{json,md} go", **OUT)
@guarded("report folder")
def mixed(classes: int, dim: int, softmax_concurrency: int, duration: float, rounds: int, out: Path) -> None:
    """Detect on one connection beside full-softmax load: one batch at a time against two lanes
    (SLC_CONCURRENT_BATCHES 1 and 2), two servers alternating."""
    from rich.progress import Progress

    from tools.bench.mixed import mixed_markdown, run_mixed
    from tools.bench.run import cached_bundle

    bundle = cached_bundle(classes, dim)
    with tempfile.TemporaryDirectory(prefix="slc-mixed-") as tmp, Progress(transient=True) as bar:
        task = bar.add_task("mixed", total=None)
        r = run_mixed(bundle, Path(tmp), duration, softmax_concurrency, rounds,
                      progress=lambda what: bar.update(task, description=what))
    command = (f"slc bench mixed --classes {classes} --dim {dim} --softmax-concurrency {softmax_concurrency} "
               f"--duration {duration:g} --rounds {rounds}")
    write_result(out, "mixed", lambda: mixed_markdown(r, command, classes), {**r, "classes": classes, "command": command})
    one, two = (r["servers"][name]["detect_beside_softmax"] for name in ("one batch at a time", "two lanes"))
    click.echo(mixed_markdown(r, command, classes))
    click.echo(f"detect p50 beside softmax load: {one['p50']:.2f} ms one batch at a time, {two['p50']:.2f} ms with two "
               f"lanes -> {out / 'mixed.md'}")


@click.command()
@click.option("--bundle", "bundle_dir", required=True, type=click.Path(path_type=Path), callback=existing_bundle)
@click.option("--inputs", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="inputs .npy [N, *input shape] (e.g. a test split); default: --samples standard normal inputs")
@click.option("--samples", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--precision", "precisions", default="int8,bf16", show_default=True)
@click.option("--out", default="docs/results", show_default=True, help="where head-precision.{json,md} go", **OUT)
@guarded("report folder", inputs=('bundle_dir', 'inputs',))
def precision(bundle_dir: Path, inputs: Optional[Path], samples: int, precisions: str, out: Path) -> None:
    """How exact the int8 / bf16 heads' answers are against float64 (no HTTP): OUT/head-precision.md."""
    import numpy as np

    from tools.bench.precision import exactness, exactness_markdown
    from serving.bundle import load_bundle

    names = [p.strip() for p in precisions.split(",") if p.strip()]
    if bad := [p for p in names if p not in ("int8", "bf16")]:
        raise click.BadParameter(f"unknown precision {bad[0]!r}; known: int8, bf16", param_hint="--precision")
    shape = load_bundle(bundle_dir, verify=False).input_shape
    x = np.load(inputs, mmap_mode="r") if inputs else \
        np.random.default_rng(0).standard_normal((samples, *shape)).astype(np.float32)
    if tuple(x.shape[1:]) != tuple(shape):
        raise click.BadParameter(f"inputs of shape {list(x.shape[1:])}, the bundle takes {list(shape)}", param_hint="--inputs")
    store = out / "head-precision.json"
    rows = json.loads(store.read_text()) if store.is_file() else []
    home = str(Path.home())
    command = f"slc bench precision --bundle {str(bundle_dir).replace(home, '~')}" + (
        f" --inputs {str(inputs).replace(home, '~')}" if inputs else f" --samples {samples}")
    for p in names:
        r = {**exactness(bundle_dir, x, p), "bundle": bundle_dir.name, "command": command,
             "inputs_from": inputs.name if inputs else "standard normal"}
        rows = [o for o in rows if (o["bundle"], o["precision"]) != (r["bundle"], p)] + [r]
        click.echo(f"{bundle_dir.name} {p}: max |dlogit| {r['max_abs_logit_error']:.3g} (logit std {r['logit_std']:.3g}), "
                   f"top-1 agreement {r['top1_agreement']:.4f}, exact top-5 after re-scoring {r['top5_exact_after_rescoring']:.4f}")
    write_result(out, "head-precision", lambda: exactness_markdown(rows), rows, indent=1)
    click.echo(f"-> {out / 'head-precision.md'}")


@click.command()
@click.option("--classes", type=click.IntRange(min=11), default=10_000_000, show_default=True)
@click.option("--dim", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--precision", type=click.Choice(["float32", "int8", "bf16"]), default="int8", show_default=True)
@click.option("--class-index", type=click.Choice(["auto", "exact", "flat", "ivf", "hnsw"]), default="exact", show_default=True,
              help="SLC_CLASS_INDEX of the large server (auto builds an index at start: minutes at 10^7)")
@click.option("--duration", type=POSITIVE, default=6.0, show_default=True, help="measured seconds per endpoint")
@click.option("--out", default="docs/results", show_default=True, **OUT)
@guarded("report folder")
def replica(classes: int, dim: int, precision: str, class_index: str, duration: float, out: Path) -> None:
    """One replica of a very large synthetic head: ready time, memory, detect / softmax / top-k latency."""
    from tools.bench.replica import bench_replica, replica_markdown

    command = (f"slc bench replica --classes {classes} --dim {dim} --precision {precision} --class-index {class_index} "
               f"--duration {duration:g}")
    with tempfile.TemporaryDirectory(prefix="slc-replica-") as tmp:
        r = bench_replica(classes, dim, precision, class_index, duration, Path(tmp))
    write_result(out, f"replica-D{classes}", lambda: replica_markdown(r, command), r, indent=1, default=float)
    click.echo(f"D={classes:,} {precision}: ready {r['large']['ready_s']:.0f} s, RSS {r['large']['memory']['rss'] / 2**30:.1f} GiB "
               f"-> {out / f'replica-D{classes}.md'}")


def _endpoints(ctx: click.Context, param: click.Parameter, value: str) -> list[str]:
    from tools.loadtest import ENDPOINT_NAMES

    names = [e.strip() for e in value.split(",") if e.strip()]
    bad = [e for e in names if e not in ENDPOINT_NAMES]
    if not names or bad:
        raise click.BadParameter(f"unknown endpoint(s) {', '.join(bad) or '(none given)'}; choose from "
                                 f"{', '.join(ENDPOINT_NAMES)}", ctx, param)
    return names


@click.command()
@click.option("--base", required=True, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="the other checkout (e.g. `git worktree add ../slc-base main`); this one is the head")
@click.option("--classes", default="10,10000", show_default=True, callback=_classes, help="comma list of D")
@click.option("--dim", type=click.IntRange(min=1), default=256, show_default=True, help="embedding size d")
@click.option("--endpoint", "endpoints", default="detect,v2,v2_binary,softmax", show_default=True, callback=_endpoints,
              help="comma list of loadtest endpoints (grpc needs the slc[grpc] extra)")
@click.option("--rounds", type=click.IntRange(min=2), default=10, show_default=True, help="alternations per endpoint")
@click.option("--block", type=POSITIVE, default=2.0, show_default=True, help="measured seconds per block")
@click.option("--concurrency", type=click.IntRange(min=1), default=8, show_default=True, help="closed-loop workers")
@click.option("--name", default="ab", show_default=True, help="the report's file stem: OUT/NAME.{json,md}")
@click.option("--out", default="docs/results", show_default=True, help="where NAME.{json,md} go", **OUT)
@guarded("report folder", inputs=('base',))
def ab(base: Path, classes: list[int], dim: int, endpoints: list[str], rounds: int, block: float, concurrency: int,
       name: str, out: Path) -> None:
    """This checkout's server against the one at --base, both up, alternating blocks: req/s, CPU per request,
    head/base with a 95 % interval. The fair before/after of a change on a noisy machine."""
    from rich.progress import Progress

    from tools.bench.ab import ab_markdown, check_checkout, run_ab
    from tools.bench.run import cached_bundle
    from tools.bench.server import grpc_available

    try:
        check_checkout(base)
        check_checkout(Path(__file__).resolve().parents[2])
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--base") from None
    if "grpc" in endpoints and not grpc_available():
        raise click.UsageError("the grpc endpoint needs the grpc extra: pip install -e '.[grpc]'")
    bundles = {D: cached_bundle(D, dim) for D in classes}
    with tempfile.TemporaryDirectory(prefix="slc-ab-") as tmp, Progress(transient=True) as bar:
        task = bar.add_task("ab", total=len(classes) * rounds * len(endpoints))
        r = run_ab(base, Path(__file__).resolve().parents[2], bundles, Path(tmp), endpoints, rounds, block, concurrency,
                   progress=lambda msg: bar.update(task, advance=1, description=msg))
    command = (f"slc bench ab --base {base} --classes {','.join(map(str, classes))} --dim {dim} "
               f"--endpoint {','.join(endpoints)} --rounds {rounds} --block {block:g} --concurrency {concurrency}"
               + (f" --name {name}" if name != "ab" else ""))
    write_result(out, name, lambda: ab_markdown(r, command), {**r, "command": command})
    click.echo(ab_markdown(r, command))
    for D, eps in r["sizes"].items():
        click.echo(f"D={int(D):,}: " + ", ".join(f"{ep} {s['head_over_base'] or 0:.3f} ({s['verdict']})" for ep, s in eps.items()))
    click.echo(f"-> {out / (name + '.md')}")


def _precisions(ctx, param, value: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(p.strip() for p in value.split(",") if p.strip()))
    bad = [p for p in names if p not in ("float32", "bf16", "int8")]
    if bad or not names:
        raise click.BadParameter(f"{', '.join(bad) or 'nothing'}: a comma list of float32, bf16, int8")
    return names


def _maybe_classes(ctx: click.Context, param: click.Parameter, value: Optional[str]) -> Optional[list[int]]:
    return None if value is None else _classes(ctx, param, value)


@click.command()
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default="cuda", show_default=True,
              help="cpu: a smoke run of every phase on the CPU provider at tiny D (says nothing about a GPU)")
@click.option("--classes", default=None, callback=_maybe_classes,
              help="comma list of D  [default: 100000,1000000,10000000 on cuda, 2000,20000 on cpu]")
@click.option("--dim", type=click.IntRange(min=1), default=None, help="embedding size d  [default: 256 on cuda, 32 on cpu]")
@click.option("--precision", "precisions", default="float32,bf16,int8", show_default=True, callback=_precisions,
              help="comma list of the head's precisions slc is measured with (the peer: float32)")
@click.option("--duration", type=POSITIVE, default=1.0, show_default=True, help="measured seconds per endpoint")
@click.option("--budget-s", type=POSITIVE, default=480.0, show_default=True,
              help="the whole check's seconds: a measurement that cannot fit what is left is skipped and listed")
@click.option("--check/--no-check", default=True, show_default=True,
              help="first the correctness check (tools/gpu_check.py: train, export, serve against offline math)")
@click.option("--peer-max-classes", type=click.IntRange(min=0), default=10_000_000, show_default=True,
              help="measure the onnxruntime peer up to this D")
@click.option("--out", default="docs/results", show_default=True, help="where gpu-bench.{json,md} go", **OUT)
@guarded("report folder")
def gpu(device: str, classes: Optional[list[int]], dim: Optional[int], precisions: tuple[str, ...], duration: float,
        budget_s: float, check: bool, peer_max_classes: int, out: Path) -> None:
    """The one prepared GPU check (make gpu-check): correctness, then slc beside an onnxruntime peer on the
    same device by D and head precision, and one connection's softmax taken apart: OUT/gpu-bench.{json,md}.
    Without CUDA: one line, exit 0."""
    from tools.bench.gpu_suite import main as suite

    command = (f"slc bench gpu --device {device}" + (f" --classes {','.join(map(str, classes))}" if classes else "")
               + (f" --dim {dim}" if dim else "") + f" --precision {','.join(precisions)} --duration {duration:g}"
               f" --budget-s {budget_s:g}" + ("" if check else " --no-check"))
    res = suite(device, classes, dim, precisions, duration, budget_s, check, peer_max_classes, out, command)
    if res is None:
        return
    servers = sum(len(r["servers"]) for r in res["rows"])
    click.echo(f"gpu check: {servers} server(s) measured in {res['elapsed_s']:.0f} s, {len(res['skipped'])} skipped "
               f"-> {out / 'gpu-bench.md'}")


@click.command()
@click.option("--classes", default="100000,1000000,10000000", show_default=True, callback=_classes, help="comma list of D")
@click.option("--dim", type=click.IntRange(min=1), default=256, show_default=True, help="embedding size d")
@click.option("--duration", type=POSITIVE, default=2.0, show_default=True, help="measured seconds per endpoint")
@click.option("--cpu-max-classes", type=click.IntRange(min=0), default=1_000_000, show_default=True,
              help="also measure the CPU server (SLC_DEVICE=cpu) up to this D")
@click.option("--precision", "precisions", default="float32", show_default=True, callback=_precisions,
              help="comma list of the head's precisions on the GPU (float32, bf16, int8); the CPU server: float32")
@click.option("--out", default="docs/results", show_default=True, help="where gpu-serving.{json,md} go", **OUT)
@guarded("report folder")
def device(classes: list[int], dim: int, duration: float, cpu_max_classes: int, precisions: tuple[str, ...],
           out: Path) -> None:
    """The server on a GPU against the device floor and the CPU server, as D grows: OUT/gpu-serving.{json,md}."""
    from serving.core.device.backend import preload_cuda, usable_providers
    from tools.bench.device import device_markdown, run_device_bench

    preload_cuda()
    if "CUDAExecutionProvider" not in (usable := usable_providers()):
        raise click.ClickException(f"no CUDA session opens here (a session gets {', '.join(usable)}): "
                                   "slc bench device needs onnxruntime-gpu and a GPU (make setup on a GPU machine)")
    with tempfile.TemporaryDirectory(prefix="slc-device-") as tmp:
        res = run_device_bench(classes, dim, duration, cpu_max_classes, Path(tmp), precisions)
    command = (f"slc bench device --classes {','.join(map(str, classes))} --dim {dim} --duration {duration:g} "
               f"--cpu-max-classes {cpu_max_classes}" + (f" --precision {','.join(precisions)}"
                                                         if precisions != ("float32",) else ""))
    write_result(out, "gpu-serving", lambda: device_markdown(res, command), res, default=str)
    md = device_markdown(res, command)
    click.echo(md)
    click.echo(f"{len(res['rows'])} sizes in {res['elapsed_s']:.0f} s -> {out / 'gpu-serving.md'}")


@click.command()
@click.option("--classes", type=click.IntRange(min=1), default=1_000_000, show_default=True, help="trained classes D")
@click.option("--enroll", type=click.IntRange(min=1), default=10_000, show_default=True, help="classes to enroll")
@click.option("--examples", type=click.IntRange(min=1), default=5, show_default=True, help="examples per enrollment")
@click.option("--negatives", type=click.IntRange(min=1), default=512, show_default=True,
              help="calibration negatives in the synthetic bundle (the standardised rule's)")
@click.option("--duration", type=POSITIVE, default=3.0, show_default=True, help="measured seconds per phase")
@click.option("--out", default="docs/results", show_default=True, help="where enroll-scale.{json,md} go", **OUT)
@guarded("report folder")
def enroll(classes: int, enroll: int, examples: int, negatives: int, duration: float, out: Path) -> None:
    """Classes enrolled into a large server: time each, detect under enrollment, memory, the limit."""
    from tools.bench.enroll_scale import enroll_markdown, run_enroll_bench

    with tempfile.TemporaryDirectory(prefix="slc-enroll-") as tmp:
        res = run_enroll_bench(classes, enroll, examples, duration, negatives, Path(tmp))
    command = (f"slc bench enroll --classes {classes} --enroll {enroll} --examples {examples} "
               f"--negatives {negatives} --duration {duration:g}")
    write_result(out, "enroll-scale", lambda: enroll_markdown(res, command), {**res, "command": command})
    click.echo(enroll_markdown(res, command))
    click.echo(f"{enroll:,} enrollments in {res['enroll_s']:.0f} s ({res['elapsed_s']:.0f} s in all) -> "
               f"{out / 'enroll-scale.md'}")


@click.command()
@click.option("--models", type=click.IntRange(min=1), default=20, show_default=True, help="class-sets on one backbone")
@click.option("--classes", type=click.IntRange(min=2), default=1000, show_default=True, help="classes of each")
@click.option("--requests", type=click.IntRange(min=10), default=1000, show_default=True, help="detect requests per round")
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--rate", type=POSITIVE, default=200.0, show_default=True, help="req/s to the served models during the churn")
@click.option("--cycles", type=click.IntRange(min=1), default=3, show_default=True, help="load/unload cycles")
@click.option("--out", default="docs/results", show_default=True, help="where many-models.{json,md} go", **OUT)
@guarded("report folder")
def many_models(models: int, classes: int, requests: int, rounds: int, rate: float, cycles: int, out: Path) -> None:
    """Many class-sets on one server sharing a backbone against one bundle: RSS, detect p50, load/unload under load."""
    from tools.bench.many_models import markdown, measure

    with tempfile.TemporaryDirectory(prefix="slc-many-models-") as tmp:
        r = measure(Path(tmp), models, classes, requests, rounds, rate, cycles)
    command = (f"slc bench many-models --models {models} --classes {classes} --requests {requests} "
               f"--rounds {rounds} --rate {rate:g} --cycles {cycles}")
    r["command"] = command
    write_result(out, "many-models", lambda: markdown(r, command), r)
    click.echo(markdown(r, command))
    click.echo(f"{models} models: RSS {r['rss_ratio']:.3f}x of one bundle plus the heads, detect p50 "
               f"{r['detect_p50_ratio']:.3f}x -> {out / 'many-models.md'}")


@click.command()
@click.option("--classes", type=click.IntRange(min=100), default=1000, show_default=True, help="classes of each bundle")
@click.option("--queue-size", type=click.IntRange(min=2), default=64, show_default=True, help="the server's SLC_QUEUE_SIZE")
@click.option("--connections", type=click.IntRange(min=1), default=16, show_default=True,
              help="the flood's connections (times --inputs: more than the queue holds)")
@click.option("--inputs", type=click.IntRange(min=1), default=16, show_default=True, help="inputs of each flood request")
@click.option("--rate", type=POSITIVE, default=2000.0, show_default=True, help="the flood's req/s asked")
@click.option("--seconds", type=POSITIVE, default=8.0, show_default=True, help="each phase's length")
@click.option("--base", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="another checkout whose server code is measured the same way in the same run (the before)")
@click.option("--out", default="docs/results", show_default=True, help="where neighbours.{json,md} go", **OUT)
@guarded("report folder")
def neighbours(classes: int, queue_size: int, connections: int, inputs: int, rate: float, seconds: float,
               base: Optional[Path], out: Path) -> None:
    """One model flooded on a backbone lane it shares with another: the other's detect latency and failures."""
    from tools.bench.neighbours import markdown, measure

    with tempfile.TemporaryDirectory(prefix="slc-neighbours-") as tmp:
        r = measure(Path(tmp), classes, queue_size, connections, seconds, rate, inputs, base)
    command = (f"slc bench neighbours --classes {classes} --queue-size {queue_size} --connections {connections} "
               f"--inputs {inputs} --rate {rate:g} --seconds {seconds:g}" + (" --base BASE" if base else ""))
    r["command"] = command
    write_result(out, "neighbours", lambda: markdown(r, command), r)
    click.echo(markdown(r, command))
    here = r["sides"]["this checkout"]["flooded"]
    click.echo(f"the other model under the flood: {here['answered']:,} answered, {sum(here['failed'].values()):,} "
               f"failed -> {out / 'neighbours.md'}")
