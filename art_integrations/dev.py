"""ART's `art.dev` names, for scripts that set `model._internal_config = art.dev.InternalModelConfig(...)`
or pass `_config=art.dev.TrainConfig(...)`. ART's are TypedDicts, plain dicts when called, and so
are these; what each field means here (applied, mapped to a backend setting, or refused naming
the way forward) is decided in `art_compat/config.py` when the model registers or trains.
"""

InternalModelConfig = dict
InitArgs = dict  # Unsloth's FastLanguageModel arguments in ART
EngineArgs = dict  # vLLM's engine arguments
PeftArgs = dict  # ART 0.5.18's adapter settings (r, lora_alpha, target_modules, ...)
LoRAConfig = dict  # ART 0.5.23's adapter settings (rank, alpha, target_modules, ...)
TrainerArgs = dict
TrainConfig = dict  # ART's experimental train settings, `_config=` of train()
TrainSFTConfig = dict  # ART's experimental SFT settings, `_config=` of train_sft() (its `metric_logging`)

__all__ = ["EngineArgs", "InitArgs", "InternalModelConfig", "LoRAConfig", "PeftArgs", "TrainConfig", "TrainSFTConfig", "TrainerArgs"]
