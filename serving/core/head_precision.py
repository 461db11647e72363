"""Which head precision serves the passes over all D classes (SLC_HEAD_PRECISION), and why.

float32     the float32 rows, nothing else timed (the default)
int8, bf16  asked for: served in that precision whatever the timings; the warm-up also times float32
            (and any other head the bundle carries, where it fits the device beside) and says so in
            GET /v1/model, with a warning where the asked head is the slower one
auto        every head the bundle carries (float32 and its int8 / bf16 copies) is timed on the runtime's
            device by the same warm-up that picks the pass's strategy (HeadPass.choose), and the one of
            least cost per input serves; one slower than float32 is never chosen (a quantized head must
            beat float32 by CHOICE_TIE to be chosen: its answers are the quantized ones)

Each precision is one HeadPass (serving/core/compute.py); those not served let go of what they hold.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

from serving.core.compute import CHOICE_TIE, HeadPass
from serving.core.device.memory import DeviceMemoryError

log = logging.getLogger(__name__)

ORDER = ("float32", "bf16", "int8")  # the order candidates are timed in (float32, the reference, first)


@dataclass
class PrecisionChoice:
    """What GET /v1/model `head_precision` says: the precision served, the setting, why, and the cost
    per input (ms, summed over the timed batch sizes) of each precision timed."""

    served: str
    setting: str
    reason: str
    cost_ms: dict[str, float] = field(default_factory=dict)
    strategy: dict[str, str] = field(default_factory=dict)  # the pass strategy each precision's warm-up chose
    not_timed: dict[str, str] = field(default_factory=dict)  # {precision: why not}

    def info(self) -> dict:
        return {"served": self.served, "setting": self.setting, "reason": self.reason,
                "cost_ms_per_input": self.cost_ms, "strategy": self.strategy, "not_timed": self.not_timed}


def carried(bundle) -> list[str]:
    """The head precisions the bundle carries, float32 first."""
    return [p for p in ORDER if p == "float32" or p in (bundle.heads or {})]


def decide(setting: str, cost: dict[str, float]) -> tuple[str, str]:
    """(precision served, why) from the setting and the measured seconds per input of each precision timed.
    Under `auto` the cheapest, where it beats float32 by more than CHOICE_TIE; float32 otherwise."""
    def ms(p: str) -> str:
        return f"{p} {1e3 * cost[p]:.4f} ms"

    measured = ", ".join(ms(p) for p in ORDER if p in cost)
    if setting == "float32":
        return "float32", "SLC_HEAD_PRECISION=float32 (nothing else timed; auto times every head the bundle carries)"
    if setting != "auto":
        slower = [p for p in cost if p != setting and setting in cost and cost[p] < cost[setting]]
        return setting, (f"asked for (SLC_HEAD_PRECISION={setting})" + (f"; measured per input: {measured}" if len(cost) > 1 else "")
                         + (f"; {' and '.join(slower)} measured faster" if slower else ""))
    if "float32" not in cost:  # float32 does not fit the device: the cheapest that does
        best = min(cost, key=cost.__getitem__)
        return best, f"auto: the float32 head does not fit the device; the cheapest that does (measured per input: {measured})"
    best = min(cost, key=cost.__getitem__)
    if best != "float32" and cost[best] < cost["float32"] / (1 + CHOICE_TIE):
        return best, f"auto: {best} the fastest, faster than float32 (measured per input: {measured})"
    if len(cost) == 1:
        return "float32", "auto: the bundle carries no other head (slc bundle quantize adds one)"
    if best == "float32":
        why = "no other head faster"
    else:
        why = f"{best} faster by less than {CHOICE_TIE:.0%}"
    return "float32", f"auto: float32 ({why}; measured per input: {measured})"


def open_pass(bundle, runtime, settings) -> HeadPass:
    """The HeadPass built at load (its admission run: a head too large for the device is one line). Under
    `auto`, float32's, or where it does not fit the device, the first carried head that does."""
    if settings.head_precision != "auto":
        return HeadPass(bundle, runtime, settings)
    first: Optional[DeviceMemoryError] = None
    for precision in carried(bundle):
        try:
            return HeadPass(bundle, runtime, settings, precision=precision)
        except DeviceMemoryError as exc:
            first = first or exc
    raise first  # type: ignore[misc]


def choose(served: HeadPass, bundle, runtime, settings) -> tuple[HeadPass, PrecisionChoice]:
    """The warm-up: `served` (open_pass's) chooses its strategy; with a setting other than float32 every
    other head the bundle carries is built, admitted (it must fit the device beside those already
    resident) and timed the same way; the precision `decide` names serves, the others are released."""
    setting = settings.head_precision
    served.choose()
    passes = {served.precision: served}
    not_timed: dict[str, str] = {}
    if setting != "float32":
        for precision in carried(bundle):
            if precision in passes:
                continue
            try:
                other = HeadPass(bundle, runtime, settings, precision=precision)
                passes[precision] = other
                other.choose()
            except Exception as exc:  # noqa: BLE001 - e.g. DeviceMemoryError: it is not timed, and said so
                not_timed[precision] = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
                if precision in passes:
                    passes.pop(precision).release_all()
    cost = {p: hp.cost() for p, hp in passes.items()}
    name, reason = decide(setting, cost)
    if setting not in ("auto", "float32") and any(cost[p] < cost[setting] for p in cost):
        log.warning("head precision %s (asked for) is measured slower than %s: SLC_HEAD_PRECISION=auto would "
                    "serve the fastest", setting, min(cost, key=cost.__getitem__))
    for precision, hp in passes.items():
        if precision != name:
            hp.release_all()
    choice = PrecisionChoice(served=name, setting=setting, reason=reason,
                             cost_ms={p: round(1e3 * c, 4) for p, c in cost.items()},
                             strategy={p: hp.name for p, hp in passes.items()}, not_timed=not_timed)
    log.info("head precision: %s (%s)", name, reason)
    return passes[name], choice
