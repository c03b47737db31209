"""fxsched.kernels: Triton kernels for the speculative-decoding hot spots.

Each module pairs ``<name>_reference`` (plain torch, the semantics of record),
``<name>_triton`` (the Triton launch) and ``<name>`` (dispatch: Triton for CUDA
tensors, or CPU tensors under ``TRITON_INTERPRET=1``; the reference otherwise):

* ``greedy_accept``: accepted-draft counts and bonus tokens per sequence from
  ragged verify rows (``row_offsets`` layout).
* ``row_argmax``: int64 argmax of each logits row, ``torch.argmax`` tie/NaN rules.
* ``gdn_fold``: copy the accepted verify row's GDN recurrent and conv state into
  the per-slot caches, in place.
* ``paged_kv_append``: write K new key/value rows per sequence through block tables.
* ``paged_attention``: causal attention of K new rows (decode or verify) over a
  block-paged KV cache, GQA allowed (its Triton kernels in ``paged_attention_jit``).
* ``gated_delta``: gated delta rule steps returning outputs and every per-token state.

The CPU kernels (``cpu_gemv``, ``cpu_amx``, ``cpu_pairs``, ``cpu_attention``, ``cpu_pointwise``, ``cpu_gdn``) are C
files compiled on first use for the host's instruction-set level (AVX512-BF16 or AVX2, ``_cpu``),
each with a torch reference and fallback; ``cpu_widen`` takes bf16 products in fp32 panels on CPUs
without bf16 arithmetic (cpu-kernels.md §15.1, §15.6).

``_triton`` holds the shared "can Triton run here" helpers; ``bench`` has
``run_kernel_bench(device, repeats)``. Submodules are imported on demand so that
importing this package never pulls in torch or triton.
"""
