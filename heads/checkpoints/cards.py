"""What model cards share: the Hub datasets a recipe trained on (a card's ``datasets`` metadata)."""

from __future__ import annotations

from pathlib import Path

HUB_DATASETS = {"sharegpt": "anon8231489123/ShareGPT_Vicuna_unfiltered"}
"""data sources the model card can name as Hub datasets (local files are not named)."""


def card_datasets(recipe: dict | None) -> list[str] | None:
    """The Hub dataset ids a recipe trained on (recipe["data"]["source"]); local files are not named."""
    data = (recipe or {}).get("data")
    source = data.get("source") if isinstance(data, dict) else None
    if not isinstance(source, str):
        return None
    if source in HUB_DATASETS:
        return [HUB_DATASETS[source]]
    is_hub_id = source.count("/") == 1 and not Path(source).suffix and not Path(source).exists()
    return [source] if is_hub_id else None
