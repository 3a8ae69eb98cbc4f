"""Run jobs from Python: the local stack (nats-server and the services as supervised processes) and the
functions a program, a notebook or the `cleave` command calls (`cleave.api.jobs`; `from cleave import ...`)."""
