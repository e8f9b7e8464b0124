"""Run by tests/test_exports_bridge.py in a process of its own: the CUDA_DEVICE_MAX_CONNECTIONS Megatron-Bridge 0.3's
own performance launcher sets for each case (recipes/run_plugins.py PerfEnvPlugin._set_num_cuda_device_max_connections,
called on a namespace with the plugin's fields; tests/bridge_readback.py stands in for what its imports need of a GPU
node). Prints the connections as one JSON list.

    python tests/bridge_connections.py CASES.json   # [{"num_gpus", "tp", "cp", "pp", "flex", "sm100", "a2a_overlap"}]
"""
import json
import sys
import types

from bridge_readback import bridge


def main() -> None:
    bridge()
    import megatron.bridge.recipes.run_plugins as plugins
    out = []
    with open(sys.argv[1]) as handle:
        cases = json.load(handle)
    for case in cases:
        plugin = types.SimpleNamespace(
            num_gpus=case["num_gpus"], tp_size=case["tp"], cp_size=case["cp"], pp_size=case["pp"],
            moe_flex_dispatcher_backend="deepep" if case["flex"] else None, gpu_sm100_or_newer=case["sm100"],
            a2a_overlap=case["a2a_overlap"])
        executor = types.SimpleNamespace(env_vars={})
        plugins.PerfEnvPlugin._set_num_cuda_device_max_connections(plugin, None, executor)
        out.append(int(executor.env_vars["CUDA_DEVICE_MAX_CONNECTIONS"]))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
