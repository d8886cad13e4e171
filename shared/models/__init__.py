"""Split-able models: the SplitModel abstraction, the model zoo, and per-split cost profiles."""
from shared.models.profile import ModelProfile, SplitCost, profile_model
from shared.models.split_model import Portion, SplitModel
from shared.models.zoo import MODEL_NAMES, build_model

__all__ = [
    "SplitModel",
    "Portion",
    "MODEL_NAMES",
    "build_model",
    "SplitCost",
    "ModelProfile",
    "profile_model",
]
