package hold

// CloseForTest drops the lease's connection as a client that dies does.
func CloseForTest(l *Lease) { _ = l.conn.Close() }
