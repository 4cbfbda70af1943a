"""Every place sglang_farskip touches SGLang 0.5.23, one row each: the list to re-check on an
SGLang upgrade (`python -m sglang_farskip.boundary check` checks it against the installed SGLang).

A row says what is touched (`target`, SGLang's dotted path, or an environment variable's name),
how (`kind`), in which processes, which module of ours owns it (`owner`, "module:attribute"), and
why. Kinds:

    before, after, around   a hook through SGLang's HookRegistry (upstream's plugin machinery)
    replace                 an SGLang attribute set to an object of ours where a hook cannot do it
    registry                an entry in one of SGLang's registries (models, attention backends)
    subclass                a method of an SGLang class that a class of ours overrides
    class-swap              an SGLang object whose class is swapped for a subclass of ours
    env                     an environment switch SGLang reads, set by us
    private                 a private SGLang attribute that our code reads

Processes (`when` for the installed kinds): "every" = every SGLang process, at plugin load;
"cpu" = every process of a CPU run, at plugin load; "http" = the launcher's HTTP process, before
it serves; "model" = when a FarSkip model is built; "launcher" = set by the launcher or the plugin
before SGLang reads it; "read" = wherever the owner runs.

`params`: for hooks, overrides and swaps, the parameter names of the target the owner relies on,
in order (the upgrade check compares them with the installed SGLang's signature). `key`: the
registry entry's name. This module is data only: it imports nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("before", "after", "around", "replace", "registry", "subclass", "class-swap", "env", "private")
HOOK_KINDS = ("before", "after", "around")
INSTALLED = HOOK_KINDS + ("replace", "registry")  # what boundary.install() puts in place
GROUPS = ("every", "cpu", "http")  # the install groups (see boundary.install)


@dataclass(frozen=True)
class Row:
    kind: str
    target: str
    owner: str
    processes: str
    why: str
    params: tuple[str, ...] = ()
    key: str | None = None
    how: str = ""  # registry: "item" (target[key] = value), "call" (target(key, value)),
    #                "decorator" (target(key)(value)), "name" (target(key): the name alone)
    only_if: str = ""  # installed kinds: "module:predicate" of ours that must answer True

    @property
    def owner_module(self) -> str:
        return self.owner.split(":", 1)[0]


_S = "sglang.srt."
_M = "sglang_farskip."

ROWS: tuple[Row, ...] = (
    # ------------------------------------------------------------ every process (plugin load)
    Row("registry", _S + "models.registry.ModelRegistry.models", _M + "models.deepseek_v3:FarSkipDeepseekV3ForCausalLM",
        "every", "serve DeepSeek-V3 checkpoints with the FarSkip class (upstream's when config.json says "
        "\"farskip\": false); SGLang's MLA detection keys on this architecture name",
        key="DeepseekV3ForCausalLM", how="item"),
    Row("registry", _S + "models.registry.ModelRegistry.models", _M + "models.instella_moe:InstellaMoEForCausalLM",
        "every", "AMD's Instella-MoE has no SGLang model class", key="InstellaMoEForCausalLM", how="item"),
    Row("around", _S + "configs.model_config.ModelConfig._derive_model_shapes", _M + "serve.plugin:derive_shapes_as_mla",
        "every", "SGLang recognises MLA from a fixed list of architecture names; Instella-MoE needs the MLA "
        "KV-cache layout", params=("self",)),
    Row("around", _S + "sampling.watermarking.core.redact_watermark_secrets", _M + "serve.redact:redact_secrets",
        "every", "the API keys never reach the start-up log, /server_info or a crash dump", params=("value",)),
    Row("around", _S + "sampling.watermarking.core.redact_watermark_command_line", _M + "serve.redact:redact_command_line",
        "every", "the keys on the launch command line are hidden wherever it is shown", params=("argv",)),
    Row("around", _S + "server_args.ServerArgs.__repr__", _M + "serve.redact:repr_without_keys",
        "every", "ServerArgs' repr prints the keys", params=("self",)),
    Row("around", _S + "managers.tokenizer_manager.TokenizerManager._server_args_for_dump", _M + "serve.redact:dump_without_keys",
        "every", "a crash dump holds the ServerArgs object, keys included", params=("self",)),
    Row("around", _S + "managers.data_parallel_controller.DataParallelController._broadcast_ports_as_server",
        _M + "serve.timeouts:bounded_port_broadcast",
        "every", "node 0 waits forever for a DP-attention peer that never comes",
        params=("self", "endpoint", "expected_clients")),
    Row("around", _S + "distributed.parallel_state.GroupCoordinator.__init__", _M + "serve.timeouts:cpu_group_bounded_by_dist_timeout",
        "every", "SGLang's gloo CPU groups wait two hours for a lost peer whatever --dist-timeout says",
        params=("self", "group_ranks", "local_rank", "torch_distributed_backend")),
    Row("around", _S + "disaggregation.common.conn.CommonKVManager.check_status", _M + "serve.kv_transfer:missing_room_is_failed",
        "every", "a race ends a PD prefill server's KV transfer thread for good", params=("self", "bootstrap_room")),
    # ------------------------------------------------------------ CPU runs (plugin load)
    Row("registry", _S + "models.deepseek_common.attention_backend_handler.AttentionBackendRegistry.register",
        _M + "cpu.attention:handle_attention_torch_native",
        "cpu", "torch_native has no MLA handler; the fallback (triton's) picks a prefill path torch_native's "
        "KV cache cannot serve", key="torch_native", how="call"),
    Row("registry", _S + "arg_groups.choices.add_chunked_prefix_cache_attention_backend", _M + "cpu.attention",
        "cpu", "model loading switches the chunked-prefix MHA path off for backends not on this list",
        key="torch_native", how="name"),
    Row("registry", _S + "layers.attention.attention_registry.register_attention_backend", _M + "cpu.spec:torch_native_backend",
        "cpu", "one torch_native backend: upstream's plus MLA dispatch, MHA prefill, target verify and draft decode",
        key="torch_native", how="decorator"),
    Row("around", _S + "layers.attention.merge_state.merge_state", _M + "cpu.attention:merge_state_any_device",
        "cpu", "upstream's merge of prefix and suffix attention is a GPU kernel", params=("prefix_output",)),
    Row("replace", _S + "model_executor.forward_batch_deepseek_mha_mixin.create_chunked_prefix_cache_kv_indices",
        _M + "cpu.attention:ChunkIndicesOnCpu",
        "cpu", "a Triton kernel, launched as kernel[grid](...): a HookRegistry wrapper is a plain function "
        "that cannot be indexed, so the object is replaced by one that launches the kernel on a GPU and "
        "fills the indices in Python on CPU"),
    Row("around", _S + "speculative.draft_utils.DraftBackendFactory._create_backend", _M + "cpu.spec:draft_backends_with_torch_native",
        "cpu", "EAGLE's draft decode knows no torch_native backend",
        params=("self", "backend_name", "backend_map", "error_template")),
    Row("around", _S + "models.deepseek_v2.DeepseekV2ForCausalLM.set_embed_and_head", _M + "cpu.spec:set_embed_and_head_on_cpu",
        "cpu", "the NextN draft's set-up ends in torch.cuda.synchronize()", params=("self", "embed", "head")),
    Row("after", _S + "layers.quantization.fp8.Fp8Config.get_quant_method", _M + "cpu.fp8:torch_native_methods",
        "cpu", "block FP8 runs on CPU only through AMX kernels (installed only where those are missing)",
        params=("self", "layer", "prefix"), only_if=_M + "cpu.fp8:without_amx"),
    Row("after", _S + "disaggregation.mooncake.conn.MooncakeKVSender.__init__", _M + "cpu.pd:host_indices_without_device",
        "cpu", "the prefill server's KV send pins memory and waits on a CUDA event", params=("self",)),
    Row("around", _S + "layers.moe.fused_moe_native.moe_forward_native", _M + "cpu.environment:native_moe_skipping_foreign_experts",
        "cpu", "with EP > 1 the native MoE indexes with the -1 ids of other ranks' experts",
        params=("layer", "x", "topk_output", "moe_runner_config")),
    Row("around", _S + "distributed.parallel_state.GroupCoordinator.reduce_scatterv", _M + "cpu.environment:reduce_scatterv_without_pynccl",
        "cpu", "DP attention with EP returns the MoE output by a reduce-scatter that insists on pynccl",
        params=("self", "input_", "output", "sizes")),
    Row("after", _S + "entrypoints.engine._set_envs_and_config", _M + "cpu.environment:start_workers_as_chosen",
        "cpu", "SGLang spawns its workers (CUDA cannot fork); on CPU forking saves each worker's SGLang import",
        params=("server_args",)),
    # ------------------------------------------------------------ the HTTP process (launcher)
    Row("before", _S + "managers.tokenizer_manager.TokenizerManager.generate_request", _M + "serve.admission:before_generate",
        "http", "fields SGLang leaves unchecked crash a scheduler or wedge the server", params=("self", "obj")),
    Row("after", _S + "entrypoints.openai.serving_completions.OpenAIServingCompletion._convert_to_internal_request",
        _M + "serve.admission:completion_check",
        "http", "the same checks with OpenAI's names, before a stream starts", params=("self", "request")),
    Row("after", _S + "entrypoints.openai.serving_chat.OpenAIServingChat._convert_to_internal_request",
        _M + "serve.admission:chat_check",
        "http", "the same checks with OpenAI's chat names, before a stream starts", params=("self", "request")),
    Row("around", _S + "entrypoints.http_server.serve_generate_request", _M + "serve.admission:around_serve_generate",
        "http", "the same checks on SGLang's native /generate, answered with a 400 before a stream starts",
        params=("obj", "request")),
    Row("after", _S + "entrypoints.openai.serving_tokenize.OpenAIServingDetokenize._convert_to_internal_request",
        _M + "serve.admission:detokenize_check",
        "http", "token ids outside the vocabulary are a 500 otherwise", params=("self", "request")),
    Row("around", _S + "utils.auth.decide_request_auth", _M + "serve.admin:inference_key_forbidden",
        "http", "the inference key on an admin route is told 403 (a key without the right), not 401",
        params=("authorization_header", "api_key", "auth_level")),
    Row("after", _S + "utils.auth._get_auth_level_from_app_and_scope", _M + "serve.admin:admin_routes_need_the_admin_key",
        "http", "SGLang opens its operator routes (ADMIN_OPTIONAL) to the inference key when no admin key is set",
        params=("app", "scope")),
    Row("after", _S + "utils.auth.app_has_admin_force_endpoints", _M + "serve.admin:always_check_keys",
        "http", "SGLang installs its key middleware only when a route is ADMIN_FORCE; the admin routes must "
        "answer 403 even on a server without keys", params=("app",)),
    # ------------------------------------------------------------ subclasses (methods overridden)
    Row("subclass", _S + "models.deepseek_v2.DeepseekV3ForCausalLM.__init__", _M + "models.deepseek_v3:FarSkipDeepseekV3ForCausalLM",
        "model", "builds upstream's model, then the FarSkip wiring and communicator",
        params=("self", "config", "quant_config", "prefix")),
    Row("subclass", _S + "models.deepseek_v2.DeepseekV2ForCausalLM.shared_experts_fusion_disable_reason",
        _M + "models.deepseek_v3:FarSkipDeepseekV3ForCausalLM",
        "model", "FarSkip reduces shared experts apart from routed experts", params=("hf_config", "quant_config")),
    Row("subclass", _S + "models.deepseek_v2.DeepseekV2Model.forward", _M + "models.deepseek_v3:FarSkipDeepseekV2Model",
        "model", "the FarSkip forward holds two pending sums; upstream's layer-boundary framework holds one",
        params=("self", "input_ids", "positions", "forward_batch", "input_embeds", "pp_proxy_tensors")),
    Row("subclass", _S + "models.deepseek_v2.DeepseekV2ForCausalLM.load_weights", _M + "models.instella_moe:InstellaMoEForCausalLM",
        "model", "Instella's attention gate is named like an MLP weight, and a skipped tensor must be an error",
        params=("self", "weights", "is_nextn")),
    Row("subclass", _S + "layers.linear.RowParallelLinear.forward", _M + "models.instella_moe:GatedOProj",
        "model", "the attention gate is applied at o_proj's input, which every MLA path passes",
        params=("self", "input_")),
    Row("subclass", _S + "models.deepseek_v2.DeepseekV2AttentionMLA.forward_prepare", _M + "models.instella_moe:GatedMLA",
        "model", "the gate is computed where every attention call starts",
        params=("self", "positions", "hidden_states", "forward_batch", "zero_allocator")),
    Row("subclass", _S + "layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_extend",
        _M + "cpu.attention:mla_prefill_backend_class()",
        "cpu", "MHA prefill over decompressed K/V, and target verify (cpu/spec.py), on torch_native",
        params=("self", "q", "k", "v", "layer", "forward_batch", "save_kv_cache")),
    Row("subclass", _S + "layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_decode",
        _M + "cpu.spec:backend_class()",
        "cpu", "EAGLE's draft decode over its draft slots",
        params=("self", "q", "k", "v", "layer", "forward_batch", "save_kv_cache")),
    Row("subclass", _S + "layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_extend",
        _M + "cpu.spec:backend_class()",
        "cpu", "target verify: the draft tokens over the verified prefix and their tree",
        params=("self", "q", "k", "v", "layer", "forward_batch", "save_kv_cache")),
    Row("subclass", _S + "layers.quantization.fp8.Fp8LinearMethod.apply", _M + "cpu.fp8:Fp8LinearMethod",
        "cpu", "block-FP8 linear by dequantizing, without AMX", params=("self", "layer", "x", "bias")),
    Row("subclass", _S + "layers.quantization.fp8.Fp8LinearMethod.process_weights_after_loading", _M + "cpu.fp8:Fp8LinearMethod",
        "cpu", "keep the FP8 weights as loaded (upstream repacks them for AMX)", params=("self", "layer")),
    Row("subclass", _S + "layers.quantization.fp8.Fp8MoEMethod.apply", _M + "cpu.fp8:Fp8MoEMethod",
        "cpu", "block-FP8 experts dequantized one at a time, without AMX", params=("self", "layer", "dispatch_output")),
    Row("subclass", _S + "layers.quantization.fp8.Fp8MoEMethod.process_weights_after_loading", _M + "cpu.fp8:Fp8MoEMethod",
        "cpu", "keep the FP8 expert weights as loaded", params=("self", "layer")),
    Row("subclass", _S + "layers.quantization.fp8.Fp8MoEMethod.create_moe_runner", _M + "cpu.fp8:Fp8MoEMethod",
        "cpu", "no kernel runner: apply() runs upstream's native expert loop", params=("self", "layer", "moe_runner_config")),
    # ------------------------------------------------------------ class swaps
    Row("class-swap", _S + "models.deepseek_v2.DeepseekV2Model", _M + "models.deepseek_v3:FarSkipDeepseekV2Model",
        "model", "DeepseekV2ForCausalLM.__init__ builds DeepseekV2Model by name: a REPLACE hook would change every "
        "model of that module, stock checkpoints and other architectures included; only a FarSkip model's "
        "instance gets the FarSkip forward", params=("self", "config", "quant_config", "prefix")),
    Row("class-swap", _S + "layers.linear.RowParallelLinear", _M + "models.instella_moe:GatedOProj",
        "model", "the attention builds o_proj by name; a REPLACE hook would gate every row-parallel layer of "
        "every model", params=("self", "input_size", "output_size")),
    Row("class-swap", _S + "models.deepseek_v2.DeepseekV2AttentionMLA", _M + "models.instella_moe:GatedMLA",
        "model", "the decoder layer builds its attention by name; only Instella's gated layers change",
        params=("self", "config", "hidden_size", "num_heads")),
    # ------------------------------------------------------------ environment switches SGLang reads
    Row("env", "SGLANG_EXTERNAL_MODEL_PACKAGE", _M + "serve.plugin:defer_upstream_model_imports",
        "launcher", "SGLang's registry imports this package's models instead of its ~260 own (seconds per process)"),
    Row("env", "SGLANG_USE_CPU_ENGINE", _M + "cpu.environment:cpu_base_environment",
        "launcher", "SGLang's CPU engine"),
    Row("env", "SGLANG_NCCL_SO_PATH", _M + "cpu.environment:cpu_base_environment",
        "launcher", "keeps SGLang from building a pynccl communicator over CPU tensors"),
    Row("env", "SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK", _M + "cpu.environment:cpu_base_environment",
        "launcher", "on CPU the free \"device\" memory is the host's, which other processes change"),
    Row("env", "SGLANG_CPU_OMP_THREADS_BIND", _M + "cpu.environment:cpu_environment",
        "launcher", "one core set per rank, required by SGLang's CPU engine at TP > 1"),
    Row("env", "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", _M + "serve.launcher:SERVER_ENVIRONMENT",
        "launcher", "/health answers the server's status instead of queueing a generation behind real requests"),
    Row("env", "SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX", _M + "cpu.pd:pd_environment",
        "launcher", "a PD prefill server on CPU sends the cached prefix with the rest"),
    Row("env", "SGLANG_HOST_IP", _M + "cpu.pd:pd_environment",
        "launcher", "a PD server listening on loopback advertises the loopback address to its peer"),
    # ------------------------------------------------------------ private attributes read
    Row("private", _S + "entrypoints.http_server._global_state", _M + "serve.admission:around_serve_generate",
        "read", "the tokenizer manager (vocabulary, context) for /generate's check"),
    Row("private", _S + "entrypoints.http_server._create_error_response", _M + "serve.admission:around_serve_generate",
        "read", "the 400 in SGLang's own error shape"),
    Row("private", _S + "distributed.parallel_state._MODEL_PARALLEL_GROUP_TIMEOUT", _M + "serve.timeouts:cpu_group_bounded_by_dist_timeout",
        "read", "the --dist-timeout SGLang gives its device groups"),
    Row("private", _S + "distributed.parallel_state.GroupCoordinator._deterministic_reduce_scatterv",
        _M + "cpu.environment:reduce_scatterv_without_pynccl",
        "read", "upstream's own rank-independent reduce-scatter"),
    Row("private", _S + "models.deepseek_common.attention_backend_handler._dispatch_mla_subtype",
        _M + "cpu.attention:handle_attention_torch_native",
        "read", "upstream's choice of the absorbed MLA method"),
    Row("private", _S + "models.deepseek_v2.DeepseekV2MoE._forward_shared_experts", _M + "models.deepseek_v3:shared_experts",
        "read", "the shared experts alone, without the routed ones"),
    Row("private", _S + "utils.auth._auth_level", _M + "serve.admin:admin_routes",
        "read", "each route's level is its endpoint's `_auth_level`, set by SGLang's auth_level decorator"),
    Row("private", _S + "models.deepseek_v2.DeepseekV2MoE._shared_expert_tp1", _M + "parallel:check_layers",
        "read", "`_shared_expert_tp1` (set when SGLANG_SHARED_EXPERT_TP1 is on): replicated shared experts "
        "would be summed tp_size times"),
)
