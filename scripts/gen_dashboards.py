"""Writes the Grafana dashboards deploy/grafana/dashboards/{training-progress,system-health}.json, which
the Helm chart ships as ConfigMaps and compose provisions. Edit the panels here, then:

    python scripts/gen_dashboards.py          # rewrite the JSON files
    python scripts/gen_dashboards.py --check  # exit 1 if they differ from what this script writes

Every expression must use metrics the services export: tests/deploy/test_dashboards.py checks the names,
tests/e2e/test_prometheus_dashboards.py runs each expression against a real Prometheus and training.
"""

import argparse
import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "deploy/grafana/dashboards"

DS = {"type": "prometheus", "uid": "${datasource}"}
R = '{run=~"$run"}'
GRID_WIDTH = 24


def sel(extra: str = "") -> str:
    """The run filter every query carries, plus `extra` matchers."""
    return '{run=~"$run"' + (", " + extra if extra else "") + "}"


def rate(metric: str, extra: str = "", by: str | None = None) -> str:
    inner = f"rate({metric}{sel(extra)}[$__rate_interval])"
    return f"sum by ({by}) ({inner})" if by else f"sum({inner})"


def gpu(expr: str) -> str:
    """DCGM exporter series of the GPUs the run's pods hold: DCGM series carry no `run`, but the exporter's
    Kubernetes mapping labels each GPU with the `namespace` and `pod` using it, and the scrape of the run's
    own services carries `namespace`, `pod` and `run` (ServiceMonitor)."""
    return (
        f"max by (Hostname, gpu, pod) (({expr}) * on (namespace, pod) group_left () group by (namespace, pod) (up{R}))"
    )


def quantile(q: float, metric: str, by: str = "", extra: str = "") -> str:
    keys = "le" + (", " + by if by else "")
    return f"histogram_quantile({q}, sum by ({keys}) (rate({metric}_bucket{sel(extra)}[$__rate_interval])))"


class Board:
    """Panels laid out left to right in rows of GRID_WIDTH columns."""

    def __init__(self):
        self.panels: list[dict] = []
        self.x = self.y = self.row_height = 0

    def _newline(self) -> None:
        self.y += self.row_height
        self.x = self.row_height = 0

    def row(self, title: str) -> None:
        if self.x:
            self._newline()
        self.panels.append(
            {
                "id": len(self.panels) + 1,
                "type": "row",
                "title": title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": GRID_WIDTH, "x": 0, "y": self.y},
                "panels": [],
            }
        )
        self.y += 1
        self.row_height = 0

    def panel(
        self,
        kind: str,
        title: str,
        desc: str,
        targets: list[tuple[str, str]],
        unit: str = "short",
        w: int = 8,
        h: int = 8,
        **extra,
    ) -> None:
        if self.x + w > GRID_WIDTH:
            self._newline()
        panel = {
            "id": len(self.panels) + 1,
            "type": kind,
            "title": title,
            "description": desc,
            "datasource": DS,
            "gridPos": {"h": h, "w": w, "x": self.x, "y": self.y},
            "targets": [
                {
                    "refId": chr(ord("A") + i),
                    "datasource": DS,
                    "expr": expr,
                    "legendFormat": legend,
                    "range": True,
                    "instant": False,
                }
                for i, (expr, legend) in enumerate(targets)
            ],
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        }
        if kind == "timeseries":
            panel["fieldConfig"]["defaults"]["custom"] = {
                "drawStyle": "line",
                "lineWidth": 1,
                "fillOpacity": 10,
                "showPoints": "never",
                "spanNulls": True,
            }
            panel["options"] = {
                "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                "tooltip": {"mode": "multi", "sort": "none"},
            }
        else:
            panel["options"] = {
                "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                "colorMode": "value",
                "graphMode": "area",
                "textMode": "auto",
                "justifyMode": "auto",
                "orientation": "auto",
            }
        panel.update(extra)
        self.panels.append(panel)
        self.x += w
        self.row_height = max(self.row_height, h)


def dashboard(uid: str, title: str, desc: str, board: Board) -> dict:
    run_query = "label_values(up, run)"
    return {
        "uid": uid,
        "title": title,
        "description": desc,
        "tags": ["openmanus-rl"],
        "editable": True,
        "schemaVersion": 39,
        "version": 1,
        "graphTooltip": 1,
        "refresh": "30s",
        "timezone": "",
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "links": [],
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                }
            ]
        },
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Data source",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                    "refresh": 1,
                    "regex": "",
                    "options": [],
                },
                {
                    "name": "run",
                    "label": "Run",
                    "type": "query",
                    "datasource": DS,
                    "definition": run_query,
                    "query": {"query": run_query, "refId": "run-values", "qryType": 1},
                    "includeAll": True,
                    "multi": True,
                    "allValue": ".*",
                    "current": {},
                    "hide": 0,
                    "refresh": 2,
                    "regex": "",
                    "sort": 1,
                    "options": [],
                },
            ]
        },
        "panels": board.panels,
    }


# -- Training progress: is the agent learning? ---------------------------------------------------------
b = Board()
b.row("Progress")
b.panel(
    "stat",
    "Learner step",
    "Last completed learner step.",
    [(f"max by (run) (omrl_learner_step{R})", "{{run}}")],
    w=4,
    h=5,
)
b.panel(
    "stat",
    "Policy version",
    "Version the learner last produced, and the oldest version a rollout server still serves.",
    [
        (f"max by (run) (omrl_learner_policy_version{R})", "learner {{run}}"),
        (f"min by (run) (omrl_rollout_policy_version{R})", "rollout (oldest) {{run}}"),
    ],
    w=5,
    h=5,
)
b.panel(
    "stat",
    "Reward mean",
    "Mean trajectory reward of the last learner batch.",
    [(f"avg by (run) (omrl_learner_reward_mean{R})", "{{run}}")],
    w=5,
    h=5,
    decimals=3,
)
b.panel(
    "stat",
    "Success rate",
    "Share of successful episodes in the last learner batch.",
    [(f"avg by (run) (omrl_learner_success_rate{R})", "{{run}}")],
    unit="percentunit",
    w=5,
    h=5,
)
b.panel(
    "stat",
    "Steps per minute",
    "Learner steps completed per minute.",
    [(f"sum by (run) (rate(omrl_learner_steps_total{R}[$__rate_interval])) * 60", "{{run}}")],
    w=5,
    h=5,
    decimals=2,
)
b.row("Reward")
b.panel(
    "timeseries",
    "Reward and success",
    "Per learner step: mean trajectory reward and share of successful episodes.",
    [(f"omrl_learner_reward_mean{R}", "reward {{run}}"), (f"omrl_learner_success_rate{R}", "success {{run}}")],
)
b.panel(
    "timeseries",
    "Reward components (learner batch)",
    "Mean weighted value of each reward function over the last learner batch.",
    [(f"omrl_learner_reward_component{R}", "{{component}} {{run}}")],
)
b.panel(
    "timeseries",
    "Reward components (reward service)",
    "Median weighted value per scored trajectory of each reward function, from the reward service's "
    "histograms (scores can be negative, so the histograms carry no _sum).",
    [(quantile(0.5, "omrl_reward_component_score", by="component"), "{{component}}")],
)
b.panel(
    "timeseries",
    "Episodes per second by outcome",
    "Finished episodes in the rollout servers' agent loops: success, failure, or lost to infrastructure "
    "(never trained on).",
    [(rate("omrl_rollout_episodes_total", by="outcome"), "{{outcome}}")],
    unit="ops",
    w=12,
)
b.panel(
    "timeseries",
    "Response length",
    "Mean model tokens per trajectory in the last learner batch.",
    [(f"omrl_learner_response_tokens_mean{R}", "{{run}}")],
    w=12,
)
b.row("Validation")
b.panel(
    "timeseries",
    "Validation success by environment",
    "Success rate on the held-out validation split (greedy unless env.validation_temperature), each time the "
    "policy version reaches a multiple of env.validation_every; one rollout server plays each validation and "
    "keeps its last result. Beside it, the training batches' success.",
    [
        (f"omrl_rollout_validation_success_rate{R}", "validation {{env}} ({{instance}})"),
        (f"avg by (run) (omrl_learner_success_rate{R})", "training batch {{run}}"),
    ],
    unit="percentunit",
    w=24,
)
b.row("Optimisation")
b.panel(
    "timeseries",
    "Loss by term",
    "Loss of the last step: total, policy (clipped surrogate) and, where present, value and KL terms.",
    [(f"omrl_learner_loss{R}", "{{term}} {{run}}")],
)
b.panel(
    "timeseries",
    "KL per token",
    "Against the policy before the update (old_policy: k3; old_policy_k1: verl's ppo_kl), the rollout engine's "
    "sampling (rollout), and the reference model where configured.",
    [(f"omrl_learner_kl{R}", "{{against}} {{run}}")],
)
b.panel(
    "timeseries",
    "Entropy",
    "Mean token entropy of the policy on the last batch.",
    [(f"omrl_learner_entropy{R}", "{{run}}")],
)
b.panel("timeseries", "Gradient norm", "Before clipping.", [(f"omrl_learner_grad_norm{R}", "{{run}}")])
b.panel(
    "timeseries",
    "Clip fraction",
    "Share of the step's tokens whose PPO ratio was clipped, whose loss the dual clip capped (negative "
    "advantages, clip_ratio_c), and whose importance weight was cut to algorithm.tis_cap.",
    [
        (f"omrl_learner_clip_fraction{R}", "ratio clipped {{run}}"),
        (f"omrl_learner_dual_clip_fraction{R}", "dual clip {{run}}"),
        (f"omrl_learner_importance_weight_capped_fraction{R}", "IS weight capped {{run}}"),
    ],
    unit="percentunit",
)
b.panel(
    "timeseries",
    "Policy staleness",
    "Mean number of policy versions between the policy that sampled a trained token and the learner's.",
    [(f"omrl_learner_staleness{R}", "{{run}}")],
)
b.panel(
    "timeseries",
    "Importance sampling",
    "Mean truncated importance weight min(pi_learner / pi_rollout, tis_cap) correcting for the rollout engine "
    "sampling from other (stale or numerically different) weights, and the mean PPO ratio pi_new / pi_old "
    "over the updated tokens; both near 1 when rollout and learner agree.",
    [
        (f"omrl_learner_importance_weight_mean{R}", "IS weight {{run}}"),
        (f"omrl_learner_ratio_mean{R}", "PPO ratio {{run}}"),
    ],
    w=24,
)
b.row("Data kept out of the update")
b.panel(
    "timeseries",
    "Groups filtered by dynamic sampling",
    "Groups per second the learner dropped because every episode got the same reward (algorithm.dynamic_sampling, "
    "DAPO); the producers play fresh groups in their place, so a high rate is rollout work spent on no signal. "
    "0 with dynamic sampling off.",
    [(f"sum by (run) (rate(omrl_learner_filtered_groups_total{R}[$__rate_interval]))", "{{run}}")],
    unit="ops",
)
b.panel(
    "timeseries",
    "Rollout correction rejections",
    "Of the last step: share of tokens the rollout correction took out of the loss (rollout_is_mode mask, or the "
    "veto), share of sequences holding such a token, and share of sequences vetoed whole "
    "(rollout_is_veto_threshold). 0 with the correction off.",
    [
        (f"omrl_learner_rollout_rejected_token_fraction{R}", "tokens {{run}}"),
        (f"omrl_learner_rollout_rejected_sequence_fraction{R}", "sequences with a rejected token {{run}}"),
        (f"omrl_learner_rollout_vetoed_sequence_fraction{R}", "sequences vetoed {{run}}"),
    ],
    unit="percentunit",
)
b.panel(
    "timeseries",
    "Skipped optimizer steps per second",
    "Optimizer steps (one per mini-batch and PPO epoch) the learner skipped because their gradient norm was not "
    "finite: that update is not applied.",
    [(f"sum by (run) (rate(omrl_learner_skipped_updates_total{R}[$__rate_interval]))", "{{run}}")],
    unit="ops",
)
b.row("Throughput")
b.panel(
    "timeseries",
    "Generated tokens per second",
    "Tokens sampled by all rollout engines.",
    [(f"sum by (run) (rate(omrl_rollout_generated_tokens_total{R}[$__rate_interval]))", "{{run}}")],
    w=6,
)
b.panel(
    "timeseries",
    "Trained tokens per second",
    "Model tokens the learner trained on.",
    [(f"sum by (run) (rate(omrl_learner_trained_tokens_total{R}[$__rate_interval]))", "{{run}}")],
    w=6,
)
b.panel(
    "timeseries",
    "Trained trajectories per second",
    "Trajectories the learner trained on (ReMax's greedy baseline episodes not counted).",
    [(f"sum by (run) (rate(omrl_learner_trained_trajectories_total{R}[$__rate_interval]))", "{{run}}")],
    unit="ops",
    w=6,
)
b.panel(
    "timeseries",
    "Step time",
    "Wall time of the last learner step and of its weight push and checkpoint.",
    [
        (f"omrl_learner_step_seconds{R}", "step {{run}}"),
        (f"omrl_learner_weight_push_seconds{R}", "weight push {{run}}"),
        (f"omrl_learner_checkpoint_seconds{R}", "checkpoint {{run}}"),
    ],
    unit="s",
    w=6,
)
training = dashboard(
    "omrl-training",
    "OpenManus-RL / Training progress",
    "Is the agent learning: reward, success, losses, KL, entropy, data filtered or rejected, and throughput of one "
    "or more runs.",
    b,
)

# -- System health: are the services healthy? ------------------------------------------------------------
GRPC_SERVICES = ("rollout", "envs", "reward")
b = Board()
b.row("Services")
b.panel(
    "stat",
    "Targets up",
    "Scraped metrics endpoints answering, by service.",
    [(f"sum by (job) (up{R})", "{{job}}")],
    w=8,
    h=5,
)
b.panel(
    "timeseries",
    "CPU by service",
    "Process CPU, in cores.",
    [(f"sum by (job) (rate(process_cpu_seconds_total{R}[$__rate_interval]))", "{{job}}")],
    w=8,
    h=5,
)
b.panel(
    "timeseries",
    "Resident memory by service",
    "Process resident memory.",
    [(f"sum by (job) (process_resident_memory_bytes{R})", "{{job}}")],
    unit="bytes",
    w=8,
    h=5,
)
b.panel(
    "timeseries",
    "gRPC requests per second by status",
    "Calls served by each gRPC service, by status code.",
    [(rate(f"omrl_{s}_grpc_requests_total", by="code"), f"{s} {{{{code}}}}") for s in GRPC_SERVICES],
    unit="reqps",
    w=12,
)
b.panel(
    "timeseries",
    "gRPC p95 latency by method",
    "95th percentile of call latency per method.",
    [(quantile(0.95, f"omrl_{s}_grpc_request_seconds", by="method"), "{{method}}") for s in GRPC_SERVICES],
    unit="s",
    w=12,
)
b.row("Rollout")
b.panel(
    "timeseries",
    "Active episodes and requests",
    "Episodes in the agent loops and generation requests inside the engines, over all rollout servers.",
    [
        (f"sum(omrl_rollout_active_episodes{R})", "episodes"),
        (f"sum(omrl_rollout_active_requests{R})", "generation requests"),
    ],
)
b.panel(
    "timeseries",
    "Queue depth",
    "Task groups claimed and waiting for a fresh enough policy, per rollout server.",
    [(f"sum by (instance) (omrl_rollout_queue_depth{R})", "{{instance}}")],
)
b.panel(
    "timeseries",
    "Generation latency",
    "Latency of one generation call (one model turn).",
    [
        (quantile(0.5, "omrl_rollout_generate_latency_seconds"), "p50"),
        (quantile(0.95, "omrl_rollout_generate_latency_seconds"), "p95"),
    ],
    unit="s",
)
b.panel(
    "timeseries",
    "Agent-loop stages",
    "Seconds per second spent in each stage of the agent loop and the producer, summed over episodes (so: "
    "episodes in that stage on average): generate is waiting on the engine; the rest is the path from an "
    "engine output to the next request (detokenise, parse, env calls, observation tokens) and around each "
    "group (reward, Redis publish, waiting for a group slot).",
    [(rate("omrl_rollout_loop_stage_seconds_sum", by="stage"), "{{stage}}")],
)
b.panel(
    "timeseries",
    "Engine idle",
    "Share of time a rollout server's engine had no generation request in flight (counted when the next "
    "request arrives). In a synchronous run (max_staleness 0) the engine idles while the learner trains.",
    [(f"sum by (instance) (rate(omrl_rollout_engine_idle_seconds_total{R}[$__rate_interval]))", "{{instance}}")],
    unit="percentunit",
)
b.panel(
    "timeseries",
    "Weight update duration",
    "Time a rollout server takes to swap in a pushed weight set.",
    [
        (quantile(0.95, "omrl_rollout_weight_update_seconds"), "p95"),
        (
            f"sum(rate(omrl_rollout_weight_update_seconds_sum{R}[$__rate_interval])) / "
            f"sum(rate(omrl_rollout_weight_update_seconds_count{R}[$__rate_interval]))",
            "mean",
        ),
    ],
    unit="s",
)
b.panel(
    "timeseries", "Policy version served", "Per rollout server.", [(f"omrl_rollout_policy_version{R}", "{{instance}}")]
)
b.panel(
    "timeseries",
    "Task groups per second by outcome",
    "Published to the stream, retried after an env/reward/engine failure, or dropped after the last attempt.",
    [(rate("omrl_rollout_groups_total", by="outcome"), "{{outcome}}")],
    unit="ops",
)
b.row("vLLM engines")
b.panel(
    "timeseries",
    "KV-cache use",
    "Share of each engine's KV-cache blocks in use (from vLLM's statistics): the rollout servers' and, with an "
    "llm_judge reward, the reward service's judge engine (its own instance).",
    [(f"max by (instance) (omrl_rollout_engine_kv_cache_usage{R})", "{{instance}}")],
    unit="percentunit",
    w=6,
)
b.panel(
    "timeseries",
    "Engine requests running and waiting",
    "Requests in each engine's batch, and queued for a place in it (KV cache or rollout.max_num_seqs full); "
    "a reward service's judge engine shows as its own instance.",
    [(f"sum by (instance, state) (omrl_rollout_engine_requests{R})", "{{state}} {{instance}}")],
    w=6,
)
b.panel(
    "timeseries",
    "Prefix-cache hit rate",
    "Share of prompt tokens found in the prefix cache (a later turn of an episode reuses its earlier turns; "
    "the cache is dropped at each weight update).",
    [
        (
            (
                f"sum by (instance) (rate(omrl_rollout_engine_prefix_cache_hits_total{R}[$__rate_interval])) / "
                f"sum by (instance) (rate(omrl_rollout_engine_prefix_cache_queries_total{R}[$__rate_interval]))"
            ),
            "{{instance}}",
        )
    ],
    unit="percentunit",
    w=6,
)
b.panel(
    "timeseries",
    "Preemptions per second",
    "Requests an engine preempted for lack of KV-cache blocks (recomputed later): the cache is too small.",
    [(f"sum by (instance) (rate(omrl_rollout_engine_preemptions_total{R}[$__rate_interval]))", "{{instance}}")],
    unit="ops",
    w=6,
)
b.row("GPUs (DCGM exporter)")
b.panel(
    "timeseries",
    "GPU utilisation",
    "Per GPU held by the run's pods (needs NVIDIA's dcgm-exporter with its Kubernetes pod mapping, scraped "
    "with its own pod labels kept: honorLabels).",
    [(gpu("DCGM_FI_DEV_GPU_UTIL"), "{{pod}} GPU {{gpu}}")],
    unit="percent",
    w=6,
)
b.panel(
    "timeseries",
    "GPU memory used",
    "Framebuffer memory in use per GPU of the run's pods.",
    [(gpu("DCGM_FI_DEV_FB_USED"), "{{pod}} GPU {{gpu}}")],
    unit="mbytes",
    w=6,
)
b.panel(
    "timeseries",
    "GPU memory used share",
    "Used / (used + free) framebuffer memory per GPU of the run's pods.",
    [(gpu("DCGM_FI_DEV_FB_USED / (DCGM_FI_DEV_FB_USED + DCGM_FI_DEV_FB_FREE)"), "{{pod}} GPU {{gpu}}")],
    unit="percentunit",
    w=6,
)
b.panel(
    "timeseries",
    "GPU power",
    "Power draw per GPU of the run's pods.",
    [(gpu("DCGM_FI_DEV_POWER_USAGE"), "{{pod}} GPU {{gpu}}")],
    unit="watt",
    w=6,
)
b.row("Environments")
b.panel(
    "timeseries",
    "Open episodes",
    "Per environment server.",
    [(f"sum by (instance) (omrl_envs_active_episodes{R})", "{{instance}}")],
)
b.panel(
    "timeseries",
    "Env step latency",
    "95th percentile of one environment step, by environment.",
    [(quantile(0.95, "omrl_envs_call_seconds", by="env", extra='op="step"'), "{{env}}")],
    unit="s",
)
b.panel(
    "timeseries",
    "Env errors per second by kind",
    "Failed environment calls by error class.",
    [(rate("omrl_envs_errors_total", by="kind"), "{{kind}}")],
    unit="ops",
)
b.panel(
    "timeseries",
    "Episode retries per second",
    "Episodes the rollout servers played again on a fresh environment after an environment or infrastructure failure.",
    [(rate("omrl_rollout_episode_retries_total"), "retries")],
    unit="ops",
)
b.panel(
    "timeseries",
    "AgentGym servers: restarts, lost episodes, stuck calls",
    "Restarts seen per server (an episode created before one is failed, never stepped again), episode calls "
    "refused for that, and calls given up with no reply (each may hold one of the server's threads).",
    [
        (f"sum by (server) (increase(omrl_envs_agentgym_restarts_total{R}[5m]))", "restarts {{server}}"),
        (f"sum by (server) (increase(omrl_envs_agentgym_episodes_lost_total{R}[5m]))", "lost {{server}}"),
        (f"max by (server) (omrl_envs_agentgym_stuck_calls{R})", "stuck {{server}}"),
    ],
)
b.panel(
    "timeseries",
    "AgentGym servers in rotation, pending closes",
    "1 while a server is in rotation (0: GET / unanswered, or recycling); closes that failed or were refused "
    "and wait for a retry.",
    [
        (f"min by (server) (omrl_envs_agentgym_server_healthy{R})", "in rotation {{server}}"),
        (f"sum by (server) (omrl_envs_agentgym_pending_closes{R})", "pending closes {{server}}"),
    ],
)
b.row("Tools")
b.panel(
    "timeseries",
    "Tool calls per second by tool and result",
    "Calls the env services ran for tool-calling agents (rollout.agent_loop: tools), by tool and result: ok, the "
    "model's mistake (unknown tool, invalid arguments) or the tool's failure (error, failed, timeout, limit, "
    "refused, unavailable).",
    [(rate("omrl_envs_tool_calls_total", by="tool, kind"), "{{tool}} {{kind}}")],
    unit="ops",
)
b.panel(
    "timeseries",
    "Tool call latency",
    "95th percentile of one tool call by tool, waiting for a sandbox slot included.",
    [(quantile(0.95, "omrl_envs_tool_call_seconds", by="tool"), "{{tool}}")],
    unit="s",
)
b.panel(
    "timeseries",
    "Policy tool calls by result",
    "Tool calls the policy made per second, as the rollout servers saw them: ok, its mistakes (unparsed, unknown, "
    "invalid, over_limit: what the invalid_tool_calls reward component counts) and the tools' failures.",
    [(rate("omrl_rollout_tool_calls_total", by="result"), "{{result}}")],
    unit="ops",
)
b.row("Reward")
b.panel(
    "timeseries",
    "Scoring latency",
    "Latency of scoring one batch of trajectories, per reward service (`job`: the run's own and each reward.servers "
    "entry its `remote` component calls, whose time is part of the former's).",
    [
        (quantile(0.5, "omrl_reward_score_seconds", by="job"), "p50 {{job}}"),
        (quantile(0.95, "omrl_reward_score_seconds", by="job"), "p95 {{job}}"),
    ],
    unit="s",
    w=12,
)
b.panel(
    "timeseries",
    "Trajectories scored, Score calls failed",
    "Trajectories each reward service scored per second (`job`: a trajectory the run's own sends to a reward.servers "
    "entry is counted by both), and per component the Score calls per second it failed (it raised, or gave a "
    "non-finite score or the wrong number of them).",
    [
        (rate("omrl_reward_trajectories_total", by="job"), "scored {{job}}"),
        (rate("omrl_reward_component_failures_total", by="component"), "failed {{component}}"),
    ],
    unit="ops",
    w=12,
)
b.panel(
    "timeseries",
    "Reward-model batches",
    "Episodes per reward-model forward pass (concurrent Score calls share one, up to the component's max_batch) "
    "and the pass's duration, median per component.",
    [
        (quantile(0.5, "omrl_reward_model_batch_size", by="component"), "batch {{component}}"),
        (quantile(0.5, "omrl_reward_model_forward_seconds", by="component"), "seconds {{component}}"),
    ],
    w=12,
)
b.panel(
    "timeseries",
    "Reward-model tokens computed",
    "Tokens per second the reward-model episodes hold (`given`) and those its passes computed (`computed`, padding "
    "included), per component: with share_prefixes a group's common prompt, the turns its episodes played alike and "
    "repeated episodes are computed once, so computed under given is what the sharing saves.",
    [(rate("omrl_reward_model_tokens_total", by="component, what"), "{{what}} {{component}}")],
    unit="ops",
    w=12,
)
b.panel(
    "timeseries",
    "Scored without a reference answer",
    "Trajectories per second a rule scorer (exact_match, math_equiv, ...) found no reference answer for in the "
    "task dataset and scored by its `missing` fallback.",
    [(rate("omrl_reward_reference_missing_total", by="component"), "{{component}}")],
    unit="ops",
    w=12,
)
b.panel(
    "timeseries",
    "LLM judge: latency and verdicts",
    "Seconds from a Score call to each judge request's answer (p50, p95), and the median verdict that parsed "
    "(0-1), per component.",
    [
        (quantile(0.5, "omrl_reward_judge_request_seconds", by="component"), "p50 {{component}}"),
        (quantile(0.95, "omrl_reward_judge_request_seconds", by="component"), "p95 {{component}}"),
        (quantile(0.5, "omrl_reward_judge_verdict", by="component"), "verdict {{component}}"),
    ],
    w=12,
)
b.panel(
    "timeseries",
    "LLM judge fallbacks",
    "Judge verdicts per second replaced by the component's fallback score: timeout (past its timeout_s), "
    "unparsable (no number in range, or neither yes nor no among the first token's top logprobs), error (the "
    "engine failed the request), too_long (the prompt exceeds the judge's max_model_len).",
    [(rate("omrl_reward_judge_fallbacks_total", by="component, reason"), "{{component}} {{reason}}")],
    unit="ops",
    w=12,
)
b.row("Trajectory stream and learner")
b.panel(
    "timeseries",
    "Stream backlog",
    "Entries in the trajectory stream, delivered to the learner but not yet acknowledged (pending), and not "
    "yet delivered (lag).",
    [
        (f"omrl_stream_length{R}", "length {{run}}"),
        (f"omrl_stream_pending{R}", "pending {{run}}"),
        (f"omrl_stream_lag{R}", "lag {{run}}"),
    ],
)
b.panel(
    "timeseries",
    "Dropped trajectories per second",
    "Trajectories the learner did not train on, by reason (stale: beyond algorithm.max_staleness).",
    [(rate("omrl_learner_dropped_trajectories_total", by="reason"), "{{reason}}")],
    unit="ops",
)
b.panel(
    "timeseries",
    "Weight push and checkpoint",
    "Wall time of the last weight push to every rollout server and of the last checkpoint.",
    [
        (f"omrl_learner_weight_push_seconds{R}", "push {{run}}"),
        (f"omrl_learner_checkpoint_seconds{R}", "checkpoint {{run}}"),
    ],
    unit="s",
)
b.panel(
    "timeseries",
    "Failed weight pushes per second",
    "Pushes a rollout server did not apply.",
    [(f"sum by (run) (rate(omrl_learner_weight_push_failures_total{R}[$__rate_interval]))", "{{run}}")],
    unit="ops",
    w=12,
)
b.panel(
    "timeseries",
    "Dead-lettered groups per second by reason",
    "Groups the learner's poison guard sent to the dead-letter stream instead of a step, by reason (an "
    "unreadable entry counts one); the producers replace them. docs/reliability.md lists the reasons.",
    [(rate("omrl_learner_dead_letters_total", by="reason"), "{{reason}}")],
    unit="ops",
    w=12,
)
b.row("Job API")
b.panel(
    "timeseries",
    "Jobs by state",
    "Jobs the job API knows, by state (not filtered by run).",
    [("sum by (state) (omrl_api_jobs)", "{{state}}")],
    w=12,
)
b.panel(
    "timeseries",
    "API p95 latency by route",
    "95th percentile of request latency (event streams: the whole stream).",
    [
        (
            "histogram_quantile(0.95, sum by (le, route) (rate(omrl_api_request_seconds_bucket[$__rate_interval])))",
            "{{route}}",
        )
    ],
    unit="s",
    w=12,
)
health = dashboard(
    "omrl-system-health",
    "OpenManus-RL / System health",
    "Are the services healthy: targets, CPU and memory, gRPC traffic and latency, rollout queue, "
    "vLLM engines (KV cache, queue, prefix cache), GPUs, environment errors, reward latency, stream "
    "backlog, dead letters.",
    b,
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args()
    stale = []
    for name, board in (("training-progress.json", training), ("system-health.json", health)):
        text = json.dumps(board, indent=2) + "\n"
        path = OUT / name
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
    if stale:
        print(f"stale: {', '.join(stale)}; run python scripts/gen_dashboards.py", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
