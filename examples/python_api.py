"""Train a tiny GPT from Python on a local stack (nats-server, a scheduler, two workers, the PS, all processes
on this machine) and hold its losses against the same job in plain PyTorch.

    .venv/bin/python examples/python_api.py

It prints one line per step, writes runs/api-example/ (metrics, logs, the job's state) and
runs/api-example-reference/, and exports the trained model to runs/api-example/model (a Hugging Face model
directory: `transformers.AutoModelForCausalLM.from_pretrained` loads it). Run again, it trains nothing (the job
in runs/api-example is done) and checks and exports the same steps.
"""

from cleave import Job, export, metrics, run

job = Job(job_id="api-example", preset="tiny", steps=4, batch_size=4, seed=1)

for m in run(job, workers=2, run_dir="runs/api-example"):  # the stack stops when the loop ends
    print(f"step {m['step']}  loss {m['loss']:.4f}  {m['step_time_s']:.2f}s  workers {m['workers']}")
# every committed step, the ones an earlier run of this script trained too (a job that is done trains none)
on_the_fleet = [m["loss"] for m in metrics("runs/api-example")]

in_pytorch = [m["loss"] for m in run(job, reference=True, run_dir="runs/api-example-reference")]
gap = max(abs(a - b) for a, b in zip(on_the_fleet, in_pytorch, strict=True))
print(f"largest loss difference against plain PyTorch: {gap:.1e}")
assert gap < 1e-4, "the fleet's step must be the step one machine would take"

done = export("runs/api-example/model", run_dir="runs/api-example")
print(f"exported {done.job.job_id} after step {done.head.step} to {done.out}")
