package idem

// ErrorClassifier is implemented, optionally, by a [Dialect] that can tell
// which of the driver's errors mean a conflict or an unavailable database
// when they come from statements idem did not send: a [Store.Do] callback's
// own statements, or a caller's own COMMIT after [Store.ClaimTx]. On a
// multi-primary cluster such as MariaDB Galera these meet conflicts that a
// single server never reports there (a certification failure aborts the
// transaction at any statement or at COMMIT).
//
// [Store.Do] passes every error of its callback through Classify before
// deciding whether to run the transaction again; [Store.Classify] exposes
// it to callers. Packages mysql, postgres and sqlite implement it.
type ErrorClassifier interface {
	// Classify returns err wrapped so that it also matches [ErrRetryable]
	// (a deadlock, a serialization or certification failure, a lock wait
	// timeout) or [ErrStoreUnavailable] (a lost connection, a server
	// shutting down or not ready to serve) when it is such a driver error,
	// and err itself otherwise (nil for nil). Everything err matched with
	// errors.Is and errors.As it still matches.
	Classify(err error) error
}

// Classify classifies an error of the caller's own statements on the store's
// database, such as the error of tx.Commit() after [Store.ClaimTx], with the
// dialect's [ErrorClassifier]: a transaction conflict then matches
// [ErrRetryable] (roll back and run the whole transaction again) and an
// unreachable or not-ready database [ErrStoreUnavailable]. Other errors,
// and every error on a dialect without a classifier, are returned unchanged.
func (s *Store[TTx]) Classify(err error) error {
	if c, ok := s.dialect.(ErrorClassifier); ok && err != nil {
		return c.Classify(err)
	}
	return err
}
