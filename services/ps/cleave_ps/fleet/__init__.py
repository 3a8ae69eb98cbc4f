"""The PS's side of the fleet: GEMMs handed from the training thread to the event loop, dealt to the workers
as tiles (the dispatcher around the dealer), their frames, link checks, verification and the plan watched."""
