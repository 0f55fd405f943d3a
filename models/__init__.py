"""Model definitions (Llama-family decoders) and their HF-style config.json files."""

VL_ARCHITECTURES = ("Qwen2_5_VLForConditionalGeneration",)


def model_class(mc):
    """The model class of a ModelConfig's architecture (imported when asked: model files import torch)."""
    if mc.architecture in VL_ARCHITECTURES:
        from models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
        return Qwen2_5_VLForConditionalGeneration
    from models.llama import LlamaForCausalLM
    return LlamaForCausalLM
