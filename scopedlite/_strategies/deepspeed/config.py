"""The DeepSpeed config of a run: the user's, completed and checked against the arguments.

``DeepSpeedStrategy(stage=..., config=..., offload_...=...)`` and ``launch(precision=...)``
may say the same thing twice; where they disagree, :class:`ZeroSettings` raises before any
process starts, naming both places.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any, Mapping

import torch

__all__ = ["STAGES", "ZeroSettings", "half_dtype"]

STAGES = (0, 1, 2, 3)
# Precision names -> the DeepSpeed config section that enables it (None: full fp32).
_PRECISION_SECTIONS: dict[str, str | None] = {
    "32-true": None,
    "bf16-mixed": "bf16",
    "bf16-true": "bf16",
    "16-mixed": "fp16",
    "16-true": "fp16",
}
_HALF_SECTIONS = ("fp16", "bf16")


def _enabled(section: Any) -> bool:
    return isinstance(section, Mapping) and bool(section.get("enabled", False))


def _read_config(config: dict[str, Any] | str | os.PathLike[str] | None) -> dict[str, Any]:
    if config is None:
        return {}
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        if not path.is_file():
            raise FileNotFoundError(f"DeepSpeedStrategy(config={str(config)!r}): no such JSON file.")
        try:
            loaded = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"DeepSpeedStrategy(config={str(config)!r}) is not valid JSON: {e}") from e
        if not isinstance(loaded, dict):
            raise ValueError(f"DeepSpeedStrategy(config={str(config)!r}) must hold a JSON object.")
        return loaded
    raise TypeError(
        f"DeepSpeedStrategy(config=...) takes a dict or the path of a JSON file, got "
        f"{type(config).__name__} ({config!r})."
    )


class ZeroSettings:
    """The ZeRO stage and offloading a DeepSpeed run asks for, and its config.

    Args: as :class:`~scopedlite.DeepSpeedStrategy`.
    """

    def __init__(
        self,
        stage: int | None,
        config: dict[str, Any] | str | os.PathLike[str] | None,
        offload_optimizer: bool | None,
        offload_parameters: bool | None,
    ) -> None:
        if stage is not None and (isinstance(stage, bool) or stage not in STAGES):
            raise ValueError(f"stage={stage!r} is not a ZeRO stage. Valid choices: {STAGES} or None.")
        for arg, value in (("offload_optimizer", offload_optimizer), ("offload_parameters", offload_parameters)):
            if value is not None and not isinstance(value, bool):
                raise TypeError(f"{arg} must be True, False or None, got {value!r}.")
        self.user_config = _read_config(config)
        zero = self.user_config.get("zero_optimization", {})
        if not isinstance(zero, Mapping):
            raise ValueError(f"config['zero_optimization'] must be a dict, got {zero!r}.")
        config_stage = zero.get("stage")
        if stage is not None and config_stage is not None and config_stage != stage:
            raise ValueError(
                f"DeepSpeedStrategy(stage={stage}) contradicts config['zero_optimization']"
                f"['stage']={config_stage!r}. Set the stage in one place."
            )
        resolved = stage if stage is not None else (config_stage if config_stage is not None else 2)
        if resolved not in STAGES:
            raise ValueError(
                f"config['zero_optimization']['stage']={resolved!r} is not a ZeRO stage. Valid choices: {STAGES}."
            )
        self.stage: int = resolved
        self.offload_optimizer = self._offload("offload_optimizer", offload_optimizer, zero)
        self.offload_parameters = self._offload("offload_param", offload_parameters, zero)
        if self.offload_parameters and self.stage != 3:
            raise ValueError(
                f"offload_parameters=True needs ZeRO stage 3 (parameters are only partitioned "
                f"there), but stage={self.stage}. Use stage=3 or strategy='deepspeed_stage_3_offload'."
            )
        if self.offload_optimizer and self.stage == 0:
            raise ValueError("offload_optimizer=True needs ZeRO stage 1, 2 or 3, not stage=0.")

    def _offload(self, key: str, requested: bool | None, zero: Mapping[str, Any]) -> bool:
        argument = "offload_parameters" if key == "offload_param" else key
        section = zero.get(key)
        device = section.get("device", "none") if isinstance(section, Mapping) else None
        configured = None if device is None else device != "none"
        if requested is not None and configured is not None and requested != configured:
            raise ValueError(
                f"DeepSpeedStrategy({argument}={requested}) contradicts config"
                f"['zero_optimization']['{key}']={dict(section)!r}. Set it in one place."  # type: ignore[arg-type]
            )
        return bool(requested if requested is not None else configured)

    def build_config(self, precision: str, accelerator: str) -> dict[str, Any]:
        """The config handed to DeepSpeed: the user's, completed by the arguments.

        Raises ``ValueError`` where the config and the arguments disagree.
        """
        if precision not in _PRECISION_SECTIONS:
            raise ValueError(
                f"precision={precision!r} is not supported by DeepSpeed. Valid choices under "
                f"strategy='deepspeed': {', '.join(repr(p) for p in _PRECISION_SECTIONS)}."
            )
        wanted = _PRECISION_SECTIONS[precision]
        if wanted == "fp16" and accelerator == "cpu":
            raise ValueError(
                f"precision={precision!r} under strategy='deepspeed' on accelerator='cpu': "
                "DeepSpeed's fp16 loss scaling is not supported on CPU. Use precision='bf16-mixed'."
            )
        config = copy.deepcopy(self.user_config)
        for section in _HALF_SECTIONS:
            if _enabled(config.get(section)) and section != wanted:
                raise ValueError(
                    f"DeepSpeed config enables {section!r} but launch(precision={precision!r}) "
                    f"asks for {'full fp32' if wanted is None else repr(wanted)}. Set the precision in "
                    f"one place: pass precision="
                    f"{'bf16-mixed' if section == 'bf16' else '16-mixed'!r} to launch, or remove "
                    f"config[{section!r}]."
                )
        if wanted is not None:
            section = config.get(wanted)
            section = dict(section) if isinstance(section, Mapping) else {}
            section["enabled"] = True
            config[wanted] = section
        zero = dict(config.get("zero_optimization", {}))
        zero["stage"] = self.stage
        if self.offload_optimizer:
            zero["offload_optimizer"] = {**zero.get("offload_optimizer", {}), "device": "cpu"}
        if self.offload_parameters:
            zero["offload_param"] = {**zero.get("offload_param", {}), "device": "cpu"}
        config["zero_optimization"] = zero
        if not any(k in config for k in ("train_batch_size", "train_micro_batch_size_per_gpu")):
            config["train_micro_batch_size_per_gpu"] = 1
        # DeepSpeed >= 0.18 clips gradients to norm 1.0 unless told otherwise: a silent change
        # to the user's training. Clipping happens when the config asks for it, not by default.
        config.setdefault("gradient_clipping", 0.0)
        config.setdefault("zero_allow_untested_optimizer", True)
        config.setdefault("zero_force_ds_cpu_optimizer", False)
        return config


def half_dtype(config: Mapping[str, Any]) -> torch.dtype | None:
    """The dtype DeepSpeed keeps the model in under ``config`` (None: fp32)."""
    if _enabled(config.get("bf16")):
        return torch.bfloat16
    if _enabled(config.get("fp16")):
        return torch.float16
    return None
