"""Model definitions (Llama-family decoders with dense or MoE MLPs, DeepSeek-V2 with MLA) and their HF-style
config.json files."""

from autoprofile.model_config import HYBRID_ARCHITECTURES, MLA_ARCHITECTURES

VL_ARCHITECTURES = ("Qwen2_5_VLForConditionalGeneration",)


def model_class(mc):
    """The model class of a ModelConfig's architecture (imported when asked: model files import torch)."""
    if mc.architecture in VL_ARCHITECTURES:
        from models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
        return Qwen2_5_VLForConditionalGeneration
    if mc.architecture == "DeepseekV3ForCausalLM":
        from models.deepseek_v2 import DeepseekV3ForCausalLM
        return DeepseekV3ForCausalLM
    if mc.architecture in HYBRID_ARCHITECTURES:
        from models.qwen3_5 import Qwen3_5ForCausalLM
        return Qwen3_5ForCausalLM
    if mc.architecture in MLA_ARCHITECTURES:
        from models.deepseek_v2 import DeepseekV2ForCausalLM
        return DeepseekV2ForCausalLM
    from models.llama import LlamaForCausalLM
    return LlamaForCausalLM
