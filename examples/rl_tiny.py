"""GRPO and DPO on the CPU: a tiny Llama learns which tokens to answer with, in seconds.

GRPO (default): each step samples ``--group`` responses to each of a few random prompts from a
rollout engine (here a Hugging Face model of the same config, as a colocated vLLM or SGLang engine
would be), which takes the trainer's weights in BF16 buckets after every step
(``megatrain.rl.rollout_weights``); the reward is the fraction of response tokens that are even
(half of them at first); advantages are normalised per group (``group_advantages``); the step trains on
``GRPOLoss`` with a KL term to a frozen BF16 reference (``Reference``). The mean reward rises.

DPO (``--dpo``): preference pairs whose chosen response is ``TARGET`` tokens and whose rejected one
is random, the reference's log-probabilities precomputed before training
(``precompute_reference``); the DPO loss falls and the chosen-over-rejected margin grows.

    python examples/rl_tiny.py                 # GRPO, 20 steps
    python examples/rl_tiny.py --dpo --steps 10
"""

from __future__ import annotations

import argparse

import torch

import megatrain
from megatrain.rl import (DPOLoss, GRPOLoss, Reference, group_advantages, interleave_pairs, precompute_reference,
                          rollout_weights)

TARGET = 7
PROMPT, RESPONSE = 8, 8
SEQ = PROMPT + RESPONSE


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


def responses_batch(prompts: torch.Tensor, responses: torch.Tensor) -> dict[str, torch.Tensor]:
    """Prompt then response in each row; only the response is supervised (labels -100 on the prompt)."""
    ids = torch.cat([prompts, responses], dim=1)
    labels = ids.clone()
    labels[:, :PROMPT] = -100
    return {"input_ids": ids, "labels": labels}


def grpo(steps: int, prompts_per_step: int, group: int, seed: int) -> list[float]:
    torch.manual_seed(seed)
    trainer = megatrain.compile(tiny_llama(), seq_len=SEQ, micro_batch_size=group,
                                micro_batches=prompts_per_step, optimizer=megatrain.AdamW(lr=1e-2),
                                reference="bfloat16")
    reference = Reference(trainer)  # the initial policy, frozen in BF16 (2 bytes per parameter)
    engine = tiny_llama().eval()  # the rollout engine: its own copy of the weights
    loss = GRPOLoss(kl_coef=0.02)
    g = torch.Generator().manual_seed(seed)
    rewards = []
    for step in range(steps):
        for bucket in rollout_weights(trainer, bucket_bytes=64 * 1024):  # the weight update an engine takes
            unknown = engine.load_state_dict(dict(bucket), strict=False).unexpected_keys
            assert not unknown, f"the engine has no weights {unknown}"
        prompts = torch.randint(10, 96, (prompts_per_step, PROMPT), generator=g).repeat_interleave(group, 0)
        with torch.no_grad():
            out = engine.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=RESPONSE,
                                  min_new_tokens=RESPONSE, do_sample=True, top_k=0, pad_token_id=0)
        batch = responses_batch(prompts, out[:, PROMPT:])
        reward = (batch["input_ids"][:, PROMPT:] % 2 == 0).float().mean(1)
        batch["advantages"] = group_advantages(reward, group)
        batch["ref_logprobs"] = reference.logprobs(batch)
        result = trainer.step(batch, loss=loss)
        rewards.append(reward.mean().item())
        print(f"step {step + 1:2d}  reward {rewards[-1]:.3f}  loss {result.loss:+.4f}")
    return rewards


def dpo(steps: int, pairs: int, seed: int) -> list[float]:
    torch.manual_seed(seed)
    trainer = megatrain.compile(tiny_llama(), seq_len=SEQ, micro_batch_size=2, micro_batches=pairs,
                                optimizer=megatrain.AdamW(lr=3e-3))
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(steps):
        prompts = torch.randint(10, 96, (pairs, PROMPT), generator=g)
        chosen = responses_batch(prompts, torch.full((pairs, RESPONSE), TARGET))
        rejected = responses_batch(prompts, torch.randint(10, 96, (pairs, RESPONSE), generator=g))
        batches.append(interleave_pairs(chosen, rejected))
    batches = precompute_reference(trainer, batches)  # before the first step: the initial policy
    loss = DPOLoss(beta=0.5)
    losses = []
    for step, batch in enumerate(batches):
        result = trainer.step(batch, loss=loss)
        losses.append(result.loss)
        print(f"step {step + 1:2d}  DPO loss {result.loss:.4f}")
    return losses


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dpo", action="store_true", help="offline DPO on synthetic preference pairs instead of GRPO")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.dpo:
        dpo(args.steps, pairs=4, seed=args.seed)
    else:
        grpo(args.steps, prompts_per_step=4, group=4, seed=args.seed)


if __name__ == "__main__":
    main()
