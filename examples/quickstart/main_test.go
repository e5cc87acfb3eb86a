package main

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// TestRun keeps the quickstart working: it fails on any error run reports.
func TestRun(t *testing.T) {
	t.Parallel()
	require.NoError(t, run(t.Context()))
}
