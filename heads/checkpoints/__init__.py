"""How every trained draft is stored and shared, whatever its kind.

    files.py     config.json + model.safetensors + README.md, written atomically, read strictly, found on the Hub
    draft.py     DraftCheckpoint: save_pretrained / from_pretrained / push_to_hub of a draft module
    hub.py       publishing files to the Hub in one commit
    cards.py     what model cards share          contents.py   what a directory holds, in words
"""
