"""The start-up calibration's measured steps in the start-up cache (kvserve.disk_cache).

A start runs the calibration (EngineCore.calibrate) before /health turns 200: 0.4 s of a
3 s start for a 1.5B Q4_K_M on 2 Zen 4 cores. A restart of the same model, configuration and
code on the same machine replays the steps kept from the last run instead, once the warm-up's
last step, measured now, agrees with what they predict for it (AGREEMENT): a machine that got
slower or faster since (a neighbour's load, another clock) calibrates again. The online fit
goes on from there as after a measured calibration.

An entry is one line of JSON: its header (everything its steps depend on) and the steps, each
the cost model's features and seconds. Its name digests the header, so a changed input is
another entry; writing one removes the others of its slot (the model's path and the
configuration asked for), so the directory holds one per way a model is served.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvserve.disk_cache import (
    cache_root,
    entry_name,
    model_fingerprint,
    read_entry,
    sources_digest,
    write_entry,
)

log = logging.getLogger(__name__)

FORMAT = 1
# measured / predicted for the warm-up's last step that lets the kept steps stand in for a
# calibration: the bimodal decode of benchmarks/RESULTS.md moves a step by ~1.4x.
AGREEMENT = (2 / 3, 3 / 2)
# The code a step's time depends on besides what `code` in the header names (the model's
# layers and kernels: kvserve.models.weight_cache.code_versions): the engine's step and the
# calibration's workload.
_PKG = Path(__file__).resolve().parent.parent
_CODE = [_PKG / p for p in ("engine/core.py", "engine/calibration.py", "sched/scheduler.py",
                            "sched/slo.py", "worker/model_runner.py",
                            "attention/torch_paged.py", "sample/sampler.py",
                            "sample/metadata.py")]

Sample = tuple[tuple[float, ...], float]


@dataclass(frozen=True)
class CalibrationCache:
    path: Path
    header: dict[str, Any]

    @classmethod
    def at(cls, model: Path, setting: dict[str, Any], machine: dict[str, Any]
           ) -> CalibrationCache | None:
        """The entry for calibrating `model` served with `setting` on `machine` (what tells
        the step times apart: kernels, threads, CPU); None with the cache off."""
        root = cache_root()
        if root is None:
            return None
        try:
            fingerprint = model_fingerprint(model)
        except OSError:  # no such file: the load says so
            return None
        code = sources_digest(_CODE)  # kvserve's own files: a missing one is a bug, not a miss
        header = {"format": FORMAT, "model": fingerprint, "setting": setting,
                  "machine": machine, "code": code}
        name = entry_name(model, {"path": fingerprint["path"], "setting": setting}, header)
        return cls(root / "calibration" / f"{name}.json", header)

    def load(self) -> list[Sample] | None:
        """The kept steps, or None (none kept, or an entry in doubt: a warning, then a
        measured calibration writes it anew)."""
        data = read_entry(self.path, "calibration")
        if data is None:
            return None
        try:
            entry = json.loads(data)
            if entry.get("header") != self.header:
                raise ValueError("its header does not match")
            steps = [(tuple(float(v) for v in x), float(y)) for x, y in entry["steps"]]
            if len(steps) < 2 or any(len(x) != len(steps[0][0]) or not y > 0
                                     for x, y in steps):
                raise ValueError("its steps are malformed")
            return steps
        except (ValueError, TypeError, KeyError) as e:
            log.warning("calibration cache: %s is unusable (%s); calibrating anew",
                        self.path.name, e)
            return None

    def save(self, steps: list[Sample]) -> None:
        line = json.dumps({"header": self.header, "steps": [[list(x), y] for x, y in steps]})
        write_entry(self.path, line.encode() + b"\n", "calibration")

def agrees(measured: float, predicted: float | None) -> bool:
    """Whether a step measured now agrees with the kept steps' prediction (AGREEMENT)."""
    return predicted is not None and predicted > 0 and \
        AGREEMENT[0] <= measured / predicted <= AGREEMENT[1]
