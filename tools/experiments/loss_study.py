"""Learning curves of one loss under one recipe, for the many-class study in docs/results/many-class-losses.md.

A self-contained loop (not trainer.train) so that every knob the study varies is explicit: the
optimizer and its learning rate, linear warmup, gradient-norm clipping, the head-bias start
(the loss's `initial_bias` or 0) and the loss's parameters. It logs, per step, the loss and
the gradient norm, and every `eval_every` steps the calibration-split accuracy (argmax over
all classes) on a fixed subset. One JSON line per recipe on stdout; `--out` appends it too.

    python -m tools.experiments.loss_study --dataset strokes:C=2000 --loss max_margin --lr 1e-3 --epochs 4
"""
from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np
import torch

from trainer.data import load_dataset
from trainer.losses import build_loss


def head_start(loss_fn, num_classes: int, init: bool, batch_size: int):
    """The loss's initial head bias (None, float or [D]) when `init`, else None (bias 0)."""
    rule = getattr(loss_fn, "initial_bias", None) if init else None
    return rule(num_classes, batch_size=batch_size) if callable(rule) else None


def build(args, splits):
    from trainer.runs import build_model

    torch.manual_seed(args.seed)
    model = build_model(args.backbone, json.loads(args.backbone_params), splits.input_shape, splits.num_classes,
                        splits.mean, splits.std)
    loss_fn = build_loss(args.loss, splits.num_classes, **json.loads(args.loss_params))
    bias = head_start(loss_fn, splits.num_classes, args.init, args.batch_size) if args.bias is None else args.bias
    if args.head_scale != 1.0:
        with torch.no_grad():
            model.head.weight.mul_(args.head_scale)
    if bias is not None:
        with torch.no_grad():
            model.head.bias.copy_(torch.as_tensor(bias, dtype=torch.float32).expand_as(model.head.bias))
    return model, loss_fn


def optimizer(args, model):
    if args.optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=args.lr)
    if args.optimizer == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    return torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=args.weight_decay)


@torch.no_grad()
def evaluate(model, x, y) -> dict:
    """Accuracy (argmax over all classes), how many distinct classes the argmax names (a collapsed
    head names a few "hub" classes for every input), and the mean spread of an example's logits."""
    model.eval()
    logits = torch.cat([model(torch.tensor(np.asarray(x[i:i + 1024], dtype=np.float32))) for i in range(0, len(x), 1024)])
    model.train()
    top = logits.argmax(1).numpy()
    return {"cal_accuracy": round(float((top == y).mean()), 4), "distinct_top1": int(len(np.unique(top))),
            "logit_std": round(float(logits.std(1).mean()), 4)}


def run(args) -> dict:
    splits = load_dataset(args.dataset)
    x, y = splits.train
    cal_x, cal_y = splits.calibration
    pick = np.random.default_rng(0).permutation(len(cal_y))[:args.eval_examples]
    cal_x, cal_y = np.asarray(cal_x[np.sort(pick)]), cal_y[np.sort(pick)]
    model, loss_fn = build(args, splits)
    opt = optimizer(args, model)
    steps_per_epoch = len(y) // args.batch_size
    total = max(1, int(args.epochs * steps_per_epoch))
    warmup = args.warmup_steps

    def factor(s):
        ramp = min(1.0, (s + 1) / warmup) if warmup > 0 else 1.0
        return ramp * (0.5 * (1 + math.cos(math.pi * min(s, total) / total)) if args.schedule == "cosine" else 1.0)

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    gen = torch.Generator().manual_seed(args.seed)
    x_t, y_t = torch.tensor(np.asarray(x)), torch.tensor(y)
    curve = {"step": [], "loss": [], "grad_norm": [], "eval_step": [], "cal_accuracy": [], "distinct_top1": [],
             "logit_std": []}
    started, step = time.perf_counter(), 0
    model.train()
    while step < total:
        perm = torch.randperm(len(y), generator=gen)
        for b in range(steps_per_epoch):
            if step >= total:
                break
            idx = perm[b * args.batch_size:(b + 1) * args.batch_size]
            if hasattr(loss_fn, "set_progress"):
                loss_fn.set_progress(step / total)
            loss = loss_fn(model(x_t[idx].float()), y_t[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip if args.clip > 0 else float("inf"))
            opt.step()
            sched.step()
            step += 1
            if step % args.log_every == 0 or step == 1:
                curve["step"].append(step), curve["loss"].append(round(loss.item(), 5))
                curve["grad_norm"].append(round(float(norm), 5))
            if step % args.eval_every == 0 or step == total:
                curve["eval_step"].append(step)
                for key, value in evaluate(model, cal_x, cal_y).items():
                    curve[key].append(value)
    return {"recipe": {k: v for k, v in vars(args).items() if k != "out"}, "num_classes": splits.num_classes,
            "steps": total, "seconds": round(time.perf_counter() - started, 1), "chance": 1.0 / splits.num_classes,
            "final_cal_accuracy": curve["cal_accuracy"][-1], **curve}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="strokes")
    p.add_argument("--backbone", default="resnet_glyph")
    p.add_argument("--backbone-params", default='{"width": 8, "embed": 128, "pool": 2}')
    p.add_argument("--loss", default="ce")
    p.add_argument("--loss-params", default="{}")
    p.add_argument("--optimizer", choices=("adam", "adamw", "sgd"), default="adam")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--schedule", choices=("cosine", "constant"), default="cosine")
    p.add_argument("--warmup-steps", type=int, default=0)
    p.add_argument("--clip", type=float, default=0.0, help="gradient-norm clipping (0 = off)")
    p.add_argument("--init", action=argparse.BooleanOptionalAction, default=True, help="loss-aware head bias")
    p.add_argument("--bias", type=float, default=None, help="start every head bias here (overrides --init)")
    p.add_argument("--head-scale", type=float, default=1.0, help="multiply the head's initial weights")
    p.add_argument("--epochs", type=float, default=3)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-examples", type=int, default=2000)
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    result = run(args)
    line = json.dumps(result)
    print(line, flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
