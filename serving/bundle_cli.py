"""`slc bundle`: synthetic bundles for scale work, quantized heads, Triton repositories (no torch)."""
from __future__ import annotations

import time
from pathlib import Path

import click

from serving.bundle.cliopts import OUT, bundle_dir as existing_bundle, guarded, slc_command
from serving.bundle.synthetic import ROW_KINDS


@click.group(no_args_is_help=True)
def bundle() -> None:
    """Bundles without training, quantized heads, and Triton model repositories."""


def _precisions(ctx: click.Context, param: click.Parameter, value: str) -> tuple[str, ...]:
    from serving.bundle.quantize import PRECISIONS

    names = tuple(dict.fromkeys(x.strip() for x in value.split(",") if x.strip()))
    if not names or any(x not in PRECISIONS for x in names):
        raise click.BadParameter(f"expected a comma list of {', '.join(PRECISIONS)}, got {value!r}", ctx, param)
    return names


@bundle.command()
@click.option("--classes", type=click.IntRange(min=1), required=True, help="number of classes D")
@click.option("--dim", type=click.IntRange(min=1), default=256, show_default=True, help="embedding size d")
@click.option("--input-dim", type=click.IntRange(min=1), default=64, show_default=True,
              help="input size of the random backbone")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--backbone-seed", type=int, default=None,
              help="draw the backbone from this seed: bundles of one backbone seed share a byte-identical "
                   "backbone.onnx (one backbone session on a server serving them) [default: --seed]")
@click.option("--rows", type=click.Choice(ROW_KINDS), default="clustered", show_default=True,
              help="clustered: rows share directions, like trained heads; gaussian: i.i.d., the worst case for an index")
@click.option("--head-precision", "precisions", default="", help="also write quantized heads: int8, bf16 or both "
              "(comma list; docs/bundle-format.md)")
@click.option("--negatives", type=click.IntRange(min=0), default=0, show_default=True,
              help="also write this many calibration negatives (random inputs' embeddings, labelled by their top class)")
@click.option("--out", required=True, help="bundle directory (a new folder, or with --overwrite a bundle)", **OUT)
@guarded("bundle")
def synthetic(classes: int, dim: int, input_dim: int, seed: int, rows: str, precisions: str, negatives: int,
              out: Path, overwrite: bool, backbone_seed: int | None = None) -> None:
    """A bundle with a random backbone and D random class rows, for scale work."""
    from serving.bundle.synthetic import build_synthetic_bundle

    wanted = _precisions(None, None, precisions) if precisions else ()
    t0 = time.perf_counter()
    build_synthetic_bundle(classes=classes, dim=dim, input_dim=input_dim, seed=seed, out=out, rows=rows,
                           negatives=negatives, heads=wanted, overwrite=overwrite, backbone_seed=backbone_seed)
    head_mb = classes * (dim + 1) * 4 / 2**20
    click.echo(f"bundle {out}: {classes:,} {rows} classes, d={dim}, head {head_mb:,.1f} MiB "
               f"({time.perf_counter() - t0:.1f} s)  -> {slc_command()} verify {out}; {slc_command()} serve {out}")


@bundle.command()
@click.argument("bundle_dir", metavar="BUNDLE", type=click.Path(path_type=Path), callback=existing_bundle)
@click.option("--precision", "precisions", default="int8", show_default=True, callback=_precisions,
              help="int8, bf16 or both (comma list)")
@guarded("bundle", out="bundle_dir", in_place=True)
def quantize(bundle_dir: Path, precisions: tuple[str, ...]) -> None:
    """Add quantized copies of the head (int8, bf16) to a bundle; the float32 head stays the reference."""
    from serving.bundle.heads import add_heads
    from serving.bundle.quantize import FILES
    from serving.bundle.verify import verify_bundle

    t0 = time.perf_counter()
    if problems := verify_bundle(bundle_dir):
        raise click.ClickException(f"{bundle_dir} does not verify, so it is not quantized: {problems[0]}")
    add_heads(bundle_dir, precisions, progress=True)
    sizes = {p: sum((bundle_dir / n).stat().st_size for n in FILES[p].values()) / 2**20 for p in precisions}
    base = (bundle_dir / "head_weight.npy").stat().st_size / 2**20
    click.echo(f"{bundle_dir}: " + ", ".join(f"{p} head {mb:,.1f} MiB" for p, mb in sizes.items())
               + f" (float32 {base:,.1f} MiB; {time.perf_counter() - t0:.1f} s)  -> {slc_command()} verify {bundle_dir}; "
               f"SLC_HEAD_PRECISION={precisions[0]} {slc_command()} serve {bundle_dir}")


@bundle.command()
@click.argument("bundle_dir", metavar="BUNDLE", type=click.Path(path_type=Path), callback=existing_bundle)
@click.option("--out", required=True, help="model repository directory (a new folder, or with --overwrite a "
              "repository slc wrote)", **OUT)
@click.option("--max-batch", type=click.IntRange(min=1), default=64, show_default=True, help="Triton max_batch_size")
@click.option("--delay-us", type=click.IntRange(min=0), default=2000, show_default=True,
              help="dynamic batching: max_queue_delay_microseconds")
@guarded("Triton repository", inputs=("bundle_dir",))
def triton(bundle_dir: Path, out: Path, overwrite: bool, max_batch: int, delay_us: int) -> None:
    """A Triton model repository (onnxruntime backend) serving the bundle's three graphs."""
    from serving.bundle.triton import write_triton_repository

    models = write_triton_repository(bundle_dir, out, max_batch, delay_us, overwrite=overwrite)
    click.echo(f"triton repository {out}: {', '.join(models)}  -> tritonserver --model-repository {out}")


@bundle.command()
@click.argument("bundle_dir", metavar="BUNDLE", type=click.Path(path_type=Path), callback=existing_bundle)
@click.option("--from", "source", required=True, metavar="DATA_DIR|URL",
              help="where the server kept its enrolled classes: its --data-dir (SQLite), or its --gallery-url "
                   "(postgresql://...)")
@click.option("--out", required=True, help="the new bundle directory (not BUNDLE; with --overwrite a bundle it "
              "replaces)", **OUT)
@guarded("bundle", inputs=("bundle_dir",))
def fold(bundle_dir: Path, source: str, out: Path, overwrite: bool) -> None:
    """A new bundle with the enrolled classes of BUNDLE as ordinary rows (docs/api.md "Enroll a class")."""
    from serving.bundle.fold import fold_bundle
    from serving.bundle.loader import load_bundle
    from serving.gallery import DB_NAME
    from serving.gallery.enrolled import open_for_bundle

    is_url = source.startswith(("postgres://", "postgresql://"))
    if not is_url and not (Path(source) / DB_NAME).is_file():
        raise click.BadParameter(f"{source} holds no {DB_NAME} (give the server's --data-dir, or its "
                                 "postgresql:// gallery URL)", param_hint="--from")
    original = load_bundle(bundle_dir, verify=False)
    trained = original.num_classes
    # keyed by the model (backbone, head rows, names), as the server keeps them: a recalibration keeps them
    store, model, _ = open_for_bundle(source if is_url else None, Path(source), original)
    try:
        records = [r for r in store.changes(0) if not r.deleted]
    finally:
        store.close()
    classes = _servable(records, original)
    if not classes:
        raise click.ClickException(f"{source} holds no enrolled classes of {bundle_dir} (model {model.key[:12]}…); "
                                   "nothing to fold")
    try:
        fold_bundle(bundle_dir, classes, out, overwrite=overwrite)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"bundle {out}: {len(classes)} enrolled classes folded into {bundle_dir}'s head as ids "
               f"{trained}..{trained + len(classes) - 1}  -> {slc_command()} verify {out}; {slc_command()} serve {out}")


def _servable(records: list, bundle) -> list:
    """The records, when a server would serve every one (ClassRow.unservable); else one line naming
    the first it would not, and nothing is folded (a fold must not drop a class quietly)."""
    def trained(name: str) -> bool:
        try:
            bundle.class_id(name)
            return True
        except KeyError:
            return False

    kept = []
    for r in records:
        why = r.unservable(bundle.embed_dim, trained)
        if why is not None:
            raise click.ClickException(f"enrolled class {r.name!r} (slot {r.slot}): {why}; nothing was folded "
                                       "(PUT it again with good examples, or DELETE it, then fold)")
        kept.append(r)
    return kept
