"""Post-training: supervised fine-tuning on conversations, LoRA adapters, DPO.

The trainer stays the one loop; these modules supply its data (sft_data, sft_dataset), which
parameters train (lora) and its loss terms (dpo). Pretraining never imports them.
"""
