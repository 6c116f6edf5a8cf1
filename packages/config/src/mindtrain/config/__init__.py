"""The mindtrain YAML schema as dataclasses: loading, validation, legacy conversion.

Imports neither numpy nor MindSpore.
"""

from mindtrain.config.__about__ import __version__
from mindtrain.config.derived import (
    DEGREE_FIELDS,
    ZERO3,
    ZERO_STRATEGIES,
    ParallelDims,
    check_degrees,
    check_zero_strategy,
    num_accumulation_steps,
    resolve_parallelism,
    total_lr_steps,
    warmup_steps,
)
from mindtrain.config.errors import ConfigError, UserError
from mindtrain.config.figures import STEP_FIGURES, StepFigures
from mindtrain.config.legacy import convert_legacy, legacy_problems
from mindtrain.config.loader import dump_config, from_dict, load_config, parse_config, to_dict
from mindtrain.config.plan import ROLES, ParallelPlan, ParamPlan, Region, UnitPlan
from mindtrain.config.recompute import RecomputePlan, layer_ids, module_matches, recompute_plan
from mindtrain.config.schema import (
    CheckpointConfig,
    CompileConfig,
    ContextConfig,
    DataLoaderConfig,
    GPTDatasetConfig,
    LoraConfig,
    LRSchedulerConfig,
    MindTrainConfig,
    ModelConfig,
    MonitorConfig,
    ValidationConfig,
    OptimizerConfig,
    ParallelismConfig,
    TrainDatasetConfig,
    TrainingConfig,
)
from mindtrain.config.startup_notes import startup_notes
from mindtrain.config.validate import (parse_data_path, parse_split, split_weights, validate_config, validate_device,
                                       validate_model)

__all__ = [
    "__version__", "DEGREE_FIELDS", "ZERO3", "ZERO_STRATEGIES", "check_degrees", "check_zero_strategy",
    "CheckpointConfig", "CompileConfig", "ConfigError", "ContextConfig", "DataLoaderConfig", "GPTDatasetConfig",
    "LoraConfig",
    "LRSchedulerConfig", "MindTrainConfig", "ModelConfig", "MonitorConfig", "ValidationConfig", "OptimizerConfig",
    "ParallelDims", "ParallelismConfig", "ParallelPlan", "ParamPlan", "ROLES", "Region", "UnitPlan", "RecomputePlan", "layer_ids", "module_matches", "recompute_plan", "STEP_FIGURES", "StepFigures", "TrainDatasetConfig", "TrainingConfig", "UserError",
    "convert_legacy", "dump_config", "from_dict", "legacy_problems", "load_config",
    "num_accumulation_steps", "parse_config", "parse_data_path", "parse_split",
    "resolve_parallelism", "split_weights", "startup_notes", "to_dict", "total_lr_steps", "validate_config", "validate_device", "validate_model",
    "warmup_steps",
]
