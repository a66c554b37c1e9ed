"""Registers the plugin in a fresh process (registration is process-wide) and prints one JSON line: for vLLM's
RoutedExperts, the model subclasses already imported, one imported after registration and one defined after it,
the vLLM class each replacement stands for and why the plugin would refuse its layers (None: served). Run by
test_vllm_plugin.py with STATIC_MOE_VLLM=1."""

import json

from static_moe.integrations import vllm as plugin


def main() -> None:
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.models.gpt_oss import GptOssRoutedExperts

    plugin.register()
    plugin.register()  # vLLM may load a plugin twice in one process
    from vllm.model_executor.models.dbrx import DbrxExperts

    class LaterExperts(RoutedExperts):
        pass

    found = {}
    for cls in (RoutedExperts, GptOssRoutedExperts, DbrxExperts, LaterExperts):
        replacement = op_registry_oot.get(cls.__name__)
        found[cls.__name__] = {
            "replaces": replacement is not None and plugin._vllm_class(replacement) is cls,
            "subclass": replacement is not None and issubclass(replacement, cls),
            "refusal": plugin._class_refusal(replacement) if replacement is not None else "not registered",
        }
    print("RESULT " + json.dumps(found), flush=True)


if __name__ == "__main__":
    main()
