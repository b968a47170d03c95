"""Every activity's name, once: what a worker registers (`@activity.defn(name=...)`) and what a workflow
schedules. A misspelt name is an AttributeError at import, not a task no worker ever picks up."""

# On each node's agent (task queue `trainguard-node-<node>`)
CHECK_NODE = "check_node"
LAUNCH_RANKS = "launch_ranks"
PARK_RANKS = "park_ranks"
REJOIN_RANKS = "rejoin_ranks"
STOP_RANKS = "stop_ranks"
WATCH_RANKS = "watch_ranks"
REQUEST_CHECKPOINT = "request_checkpoint"
DOWNLOAD_SHARDS = "download_shards"
COLLECT_EVIDENCE = "collect_evidence"
READ_RANK_LOG = "read_rank_log"
INJECT_FAULT = "inject_fault"

# On the controller (the run's task queue): the checkpoint store, the node pool, the cluster scheduler
FIND_NODE_AGENTS = "find_node_agents"
FIND_AGENTS_BACK = "find_agents_back"
VERIFY_REGISTRATION = "verify_registration"
ACQUIRE_NODES = "acquire_nodes"
RELEASE_NODES = "release_nodes"
CORDON_NODE = "cordon_node"
PUBLISH_ATTEMPT = "publish_attempt"
FIND_CHECKPOINT = "find_checkpoint"
COMMIT_CHECKPOINTS = "commit_checkpoints"
NOTIFY_SCHEDULER = "notify_scheduler"
