"""Per-layer plans: patterns -> technique configs, the config registry, `apply`, `save`/`load`."""
from workbench.plans.apply import ApplyError, applied_plans, apply, build_skeleton
from workbench.plans.plan import PLAN_FORMAT_VERSION, Assignment, Plan
from workbench.plans.registry import Config, config_from_dict, config_to_dict, register_config, registered_kinds

__all__ = ["Plan", "Assignment", "PLAN_FORMAT_VERSION", "Config", "register_config", "registered_kinds",
           "config_from_dict", "config_to_dict", "apply", "build_skeleton", "applied_plans", "ApplyError"]
