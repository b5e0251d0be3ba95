"""Validate the cost model on the machine it runs on: time the project's own GPT, serving
engine and training step over a grid, beside the cost model's prediction for each point.

    grid.py        which points: families (decode / prefill / train steps; backbone /
                   attention / unembedding ops), shapes, V, B, T; full, quick, test presets
    prediction.py  the cost model's figure per point (CostModel on Python floats, float32)
    timing.py      building each point's call and timing all points round-robin
    run.py         ``validate()``: the device (a profile, or ceilings measured now), the run
    saved.py       ``read_validation()``: a saved run read back and priced again;
                   ``combine_runs()``: several runs of one grid as each point's median
    report.py      rows, the error summary, the JSON document, the predicted/measured figure,
                   a calibrated profile's parameters
"""

from vocabjax.validation.grid import FAMILIES, GRIDS, Grid, Point, get_grid
from vocabjax.validation.prediction import OpRow, Prediction, call_flops, predict
from vocabjax.validation.report import (
    document,
    headline,
    plot,
    point_rows,
    profile_rows,
    summary,
    summary_rows,
)
from vocabjax.validation.run import (
    MEASURE,
    Result,
    Validation,
    device_mismatch,
    load_validation_device,
    profile_kind,
    validate,
)
from vocabjax.validation.saved import (
    combine_runs,
    measured_fields,
    read_validation,
    read_validations,
)

__all__ = [
    "FAMILIES",
    "GRIDS",
    "MEASURE",
    "Grid",
    "OpRow",
    "Point",
    "Prediction",
    "Result",
    "Validation",
    "call_flops",
    "combine_runs",
    "device_mismatch",
    "document",
    "get_grid",
    "headline",
    "load_validation_device",
    "measured_fields",
    "plot",
    "point_rows",
    "predict",
    "profile_rows",
    "profile_kind",
    "read_validation",
    "read_validations",
    "summary",
    "summary_rows",
    "validate",
]
