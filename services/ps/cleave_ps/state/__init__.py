"""What a PS job keeps in JetStream: the commit protocol (epoch, head, metrics), the streamed checkpoint and
the collection of checkpoints no head names any more."""
