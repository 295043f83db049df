"""Per-layer plans: patterns -> technique configs, model-level stages (`workbench.plans.stages`), the config registry,
`apply`, `save`/`load`, and the per-layer steps of the core (`workbench.plans.layers`) that every path changing layers
calls."""
from workbench.plans.apply import (
    ApplyError,
    applied_plans,
    applied_report,
    apply,
    build_skeleton,
    normalize_calibration,
)
from workbench.plans.layers import (
    Transformed,
    canonical_view,
    capture_inputs,
    compressible_layers,
    default_configs,
    record_plan,
    share_tied,
    skeleton_layer,
    swap_layers,
    tie_groups,
    transform_layer,
)
from workbench.plans.plan import PLAN_FORMAT_VERSION, Assignment, PassedOver, Plan
from workbench.plans.registry import (
    Config,
    Handler,
    StageHandler,
    config_from_dict,
    config_to_dict,
    handler_for,
    register_config,
    registered_kinds,
)
from workbench.plans.sequential import Pipeline
from workbench.plans.stages import FoldBatchNorm

__all__ = ["Plan", "Pipeline", "Handler", "StageHandler", "FoldBatchNorm", "handler_for", "Assignment", "PassedOver",
           "PLAN_FORMAT_VERSION", "Config", "register_config", "registered_kinds", "config_from_dict",
           "config_to_dict", "apply", "build_skeleton", "applied_plans", "applied_report", "ApplyError",
           "normalize_calibration", "Transformed", "transform_layer", "skeleton_layer", "capture_inputs",
           "canonical_view", "compressible_layers", "default_configs", "swap_layers", "tie_groups", "share_tied",
           "record_plan"]
