"""One-line messages for a plug-in's parameters that do not validate, each naming its config key."""
from __future__ import annotations

from pydantic import BaseModel, ValidationError


def params_error(where: str, params: type[BaseModel], exc: ValidationError) -> str:
    """What is wrong with the parameters under the config key ``where``, each problem naming its
    key as the config loader does: ``aggregation.params.clip: must be greater than 0 (got -1)``."""
    problems = []
    for err in exc.errors(include_url=False):
        key = ".".join([where, *(str(part) for part in err["loc"])])
        if err["type"] == "extra_forbidden":
            problems.append(f"{key}: unknown key (valid keys: {', '.join(params.model_fields) or 'none'})")
            continue
        message = err["msg"].removeprefix("Value error, ").replace("Input should be", "must be")
        got = "" if err["type"] == "value_error" else f" (got {err.get('input')!r})"
        problems.append(f"{key}: {message}{got}")
    return "; ".join(problems)
