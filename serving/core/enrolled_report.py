"""What a server does not serve of the enrolled classes its store holds, and why (issue 48), so that
no class disappears silently: logged at WARNING at start and listed in GET /v1/classes `not_served`.

Groups, one per key of the store other than this model's (serving/gallery/enrolled_models.py):
  head_changed   made for this backbone with other head rows or class names (`slc calibrate
                 --adapt-rows`, a new head): their rows and biases were scaled to that head
  model_changed  made for an earlier model of this bundle (same path or name, another backbone: a new export)
  other_model    another model's (another bundle sharing the store): its server serves them
  unknown_model  kept by an older slc under a manifest digest that cannot be tied to this model
  folded         every one of them is a trained class of this bundle now (slc bundle fold)
and `unservable`: this model's stored rows that cannot be served (serving/core/enrolled.py unservable).
The store keeps each class's row, not its examples, so none can be re-embedded: the actions say so.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Optional

log = logging.getLogger(__name__)

LOGGED_NAMES = 10  # names per group in the log line (GET /v1/classes lists up to SAMPLE)

_REMAKE = ("the store keeps each class's row, not its examples, so they cannot be re-embedded under this model: "
           "re-enroll each with its examples (PUT /v1/classes/{name}), or serve the bundle they were made for and fold "
           "them into it (slc bundle fold BUNDLE --from %s --out NEW)")


def groups(store, model, settings, is_trained: Callable[[str], bool] = lambda name: False) -> list[dict]:
    """One group per other key of `store` holding live classes (module docstring); `is_trained(name)`:
    whether this bundle has a trained class of that name (a fold made them rows of the head)."""
    models = store.models()
    source = "$SLC_GALLERY_URL" if getattr(settings, "gallery_url", None) else str(getattr(settings, "data_dir", "DATA"))
    out = []
    for key, (count, sample) in store.elsewhere().items():
        other = models.get(key)
        folded = count == len(sample) and all(is_trained(name) for _, name, _ in sample)
        reason = "folded" if folded else _reason(other, model)
        out.append({"reason": reason, "count": count, "message": _message(reason, other, key, count),
                    "action": _action(reason, other, source),
                    "model": other.describe() if other is not None else {"manifest_digest": key},
                    "classes": [{"class_name": name, "slot": slot, "created": created} for slot, name, created in sample]})
    return out


def _reason(other, model) -> str:
    if other is None:
        return "unknown_model"
    if other.backbone == model.backbone:
        return "head_changed"
    return "model_changed" if other.path == model.path or other.name == model.name else "other_model"


def _message(reason: str, other, key: str, count: int) -> str:
    if other is None and reason == "folded":
        return f"{count} enrolled classes kept under manifest digest {key[:12]}… are trained classes of this bundle now"
    if other is None:
        return (f"{count} enrolled classes were stored by an earlier slc under manifest digest {key[:12]}…, which "
                "cannot be tied to this model (only the served manifest and the one before its last recalibration can)")
    where = (f"bundle {other.name!r} at {other.path}, model {other.key[:12]}…, "
             f"last opened {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(other.seen))}")
    if reason == "folded":
        return f"{count} enrolled classes of another model ({where}) are trained classes of this bundle now"
    return {"head_changed": f"{count} enrolled classes were made for this backbone with other head rows or class names "
                            f"({where}): their rows and biases were scaled to that head, so they no longer apply",
            "model_changed": f"{count} enrolled classes were made for an earlier model of this bundle ({where}, another "
                             "backbone): they no longer apply",
            "other_model": f"{count} enrolled classes belong to another model ({where})"}[reason]


def _action(reason: str, other, source: str) -> str:
    if reason == "folded":
        return "nothing: this bundle serves them as trained classes (their ids are the folded bundle's)"
    if reason == "other_model":
        return f"a server of that bundle serves them; to fold them into it: slc bundle fold {other.path} --from {source} --out NEW"
    if reason == "unknown_model":
        return ("serve the bundle whose manifest.json has that sha256 (its start re-keys them to its model), "
                "or re-enroll them here (PUT /v1/classes/{name})")
    return _REMAKE % source


def mark_reenrolled(group: dict, is_live: Callable[[str], bool]) -> dict:
    """The group with each class marked `re_enrolled` when this model serves a class of its name now."""
    return {**group, "classes": [{**c, "re_enrolled": bool(is_live(c["class_name"]))} for c in group["classes"]]}


def unservable_group(num_trained: int, skipped: dict[int, tuple[str, str]]) -> dict:
    """This model's stored rows that cannot be served {slot: (name, why)}."""
    return {"reason": "unservable", "count": len(skipped),
            "message": f"{len(skipped)} enrolled classes of this model are stored with values that cannot be served",
            "action": "replace each (PUT /v1/classes/{name}) or delete it by id (DELETE /v1/classes/{class_id})",
            "model": None,
            "classes": [{"class_name": name, "slot": slot, "class_id": num_trained + slot, "problem": why}
                        for slot, (name, why) in sorted(skipped.items())]}


def log_start(served: int, found: list[dict], adopted: Optional[list] = None) -> None:
    """At start: the classes served, those re-keyed from an older slc's digests (INFO, or WARNING when
    some were renumbered or merged), and every group not served (WARNING)."""
    for a in adopted or []:
        note = (f"; of the same names, {len(a.replaced)} later ones replaced this model's ({', '.join(a.replaced)}) and "
                f"{len(a.dropped)} older ones went ({', '.join(a.dropped)})" if a.replaced or a.dropped else "")
        level = logging.WARNING if a.renumbered else logging.INFO
        log.log(level, "enrolled classes: %d stored by an older slc under manifest digest %s… re-keyed to this model%s%s",
                a.moved, a.digest[:12], " under new ids (it held classes already)" if a.renumbered else " (ids kept)", note)
    if served:
        log.info("enrolled classes: %d of this model served", served)
    for g in found:
        names = [c["class_name"] for c in g["classes"]]
        shown = ", ".join(repr(n) for n in names[:LOGGED_NAMES]) + (", …" if g["count"] > LOGGED_NAMES else "")
        level = logging.INFO if g["reason"] == "folded" else logging.WARNING  # folded: served, as trained classes
        log.log(level, "enrolled classes not served (%s): %s: %s. To carry them over: %s", g["reason"], g["message"],
                shown, g["action"])
