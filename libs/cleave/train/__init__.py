"""One training job on the PS: its configuration, data and sources, precision, learning-rate schedule, the
memory preflight and the trainer that runs a step."""
