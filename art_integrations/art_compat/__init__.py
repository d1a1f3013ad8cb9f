"""ART compatibility: what lets an ART script run with `import art_integrations as art`.

- `names.py`: ART's names that mean something else here or nothing, each with the way forward;
- `config.py`: ART's config objects (`_internal_config`, `art.dev.TrainConfig`, `lora_config`) field
  by field, each applied, mapped to a backend setting, or refused by name;
- `format.py`: our trajectories as ART's JSON.

ART's own module paths stay where its scripts import them: `art_integrations.dev`,
`art_integrations.local` and `art_integrations.utils` (`utils/sft.py`: SFT from a JSONL file).
"""
