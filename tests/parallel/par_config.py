"""A tiny config whose head, expert and vocabulary counts divide by 8, so TP up to 8 splits something real;
2 KV heads, as in the release, so TP > 2 exercises the replicated-KV rule. 6 layers of period 2 (GDN, QSA): the
PLE group runs unrolled, the other two groups under lax.scan (a leading reps axis on their params and state)."""

PAR = dict(
    hidden_act="silu", rms_norm_eps=1e-6, max_position_embeddings=4096, tie_word_embeddings=False,
    linear_conv_kernel_dim=4, ple_conv_kernel_size=4, indexer_kv_heads=1,
    vocab_size=256, hidden_size=32, num_hidden_layers=6, full_attention_interval=2,
    num_attention_heads=8, num_key_value_heads=2, head_dim=16,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                     "mrope_section": [2, 1, 1], "mrope_interleaved": True},
    linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=8, linear_value_head_dim=8,
    output_gate_type="sigmoid", hc_count=4, hc_lowrank=8,
    ple_layer_ids=[1], ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=97,
    make_ngram_vocab_size_divisible_by=16, split_ngram_parts=4,
    indexer_n_heads=4, indexer_head_dim=16, indexer_budget=16, indexer_compress_ratio=4,
    num_experts=16, num_experts_per_tok=4, moe_intermediate_size=16, shared_expert_intermediate_size=16,
    eos_token_id=255, bos_token_id=255,
)
