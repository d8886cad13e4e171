"""Split-able models: the SplitModel abstraction, model loading (built-in names and import paths),
the model zoo, per-split cost profiles and the model fingerprint."""
from shared.models.fingerprint import ModelFingerprint, fingerprint_differences, model_fingerprint
from shared.models.loading import (
    ModelDefinition, build_model, build_model_layout, check_model_origin, is_import_path,
)
from shared.models.profile import ModelProfile, SplitCost, candidate_split_points, profile_model
from shared.models.split_model import DevicePortion, Portion, SplitModel
from shared.models.zoo import MODEL_NAMES

__all__ = [
    "SplitModel",
    "Portion",
    "DevicePortion",
    "MODEL_NAMES",
    "ModelDefinition",
    "build_model",
    "build_model_layout",
    "check_model_origin",
    "is_import_path",
    "SplitCost",
    "ModelProfile",
    "profile_model",
    "candidate_split_points",
    "ModelFingerprint",
    "model_fingerprint",
    "fingerprint_differences",
]
