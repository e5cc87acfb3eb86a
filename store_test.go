package idem_test

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem"
)

func TestNewFingerprint(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name string
		a, b [][]byte
		same bool
	}{
		{"identical parts", [][]byte{[]byte("POST"), []byte("/orders")}, [][]byte{[]byte("POST"), []byte("/orders")}, true},
		{"boundaries matter", [][]byte{[]byte("ab"), []byte("c")}, [][]byte{[]byte("a"), []byte("bc")}, false},
		{"empty part counts", [][]byte{[]byte("a"), {}}, [][]byte{[]byte("a")}, false},
		{"order matters", [][]byte{[]byte("a"), []byte("b")}, [][]byte{[]byte("b"), []byte("a")}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			a, b := idem.NewFingerprint(tt.a...), idem.NewFingerprint(tt.b...)
			require.Equal(t, tt.same, a.Equal(b))
			require.Equal(t, tt.same, a == b)
		})
	}
}

func TestStatus(t *testing.T) {
	t.Parallel()
	require.Equal(t, "processing", idem.StatusProcessing.String())
	require.Equal(t, "succeeded", idem.StatusSucceeded.String())
	require.Equal(t, "failed", idem.StatusFailed.String())
	require.Equal(t, "unknown", idem.Status(9).String())
	require.False(t, idem.StatusProcessing.Final())
	require.True(t, idem.StatusSucceeded.Final())
	require.True(t, idem.StatusFailed.Final())
}

func TestInProgressError(t *testing.T) {
	t.Parallel()
	err := fmt.Errorf("wrapped: %w", &idem.InProgressError{KeyDigest: "0123abcd", RetryAfter: 1500 * time.Millisecond, TxAborted: true})
	require.ErrorIs(t, err, idem.ErrInProgress)
	require.NotErrorIs(t, err, idem.ErrFingerprint)
	var ip *idem.InProgressError
	require.ErrorAs(t, err, &ip)
	require.Equal(t, 1500*time.Millisecond, ip.RetryAfter)
	require.True(t, ip.TxAborted)
}

func TestSentinelsAreDistinct(t *testing.T) {
	t.Parallel()
	all := []error{idem.ErrNotFound, idem.ErrInProgress, idem.ErrFingerprint, idem.ErrFenced,
		idem.ErrInvalidKey, idem.ErrInvalidScope, idem.ErrStoreUnavailable, idem.ErrRetryable}
	for i, a := range all {
		for j, b := range all {
			require.Equal(t, i == j, errors.Is(a, b), "%v vs %v", a, b)
		}
	}
}

func TestNewValidatesConfig(t *testing.T) {
	t.Parallel()
	d := newSQLiteDialect(t)
	tests := []struct {
		name string
		cfg  *idem.Config
		ok   bool
	}{
		{"nil config means defaults", nil, true},
		{"zero config means defaults", &idem.Config{}, true},
		{"negative lease", &idem.Config{LeaseDuration: -time.Second}, false},
		{"negative retention", &idem.Config{Retention: -time.Second}, false},
		{"negative wait", &idem.Config{WaitTimeout: -time.Second}, false},
		{"retention shorter than lease", &idem.Config{LeaseDuration: time.Hour, Retention: time.Minute}, false},
		{"negative retries disable retrying", &idem.Config{MaxTxRetries: -1}, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			s, err := idem.New(d, tt.cfg)
			if tt.ok {
				require.NoError(t, err)
				require.NotNil(t, s)
			} else {
				require.Error(t, err)
				require.Nil(t, s)
			}
		})
	}

	_, err := idem.New[any](nil, nil)
	require.Error(t, err)
}
