package logscan

import (
	"log/slog"
	"regexp"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestScanFindsSecretsInEveryForm(t *testing.T) {
	r := New()
	r.Secret("key", "key-0123456789")
	r.Secret("body", `{"amount":"42"}`)
	r.Secret("short", "abc") // ignored: too short to mean anything
	log := r.Logger().With("svc", "x").WithGroup("g")
	log.Info("fine", "key", "1f2e3d4c5b6a7988")
	require.Empty(t, r.Scan())

	log.Debug("oops", "err", "lookup key-0123456789 failed")
	log.Warn("nested", slog.Group("inner", "body", `{"amount":"42"}`)) // JSON-escaped in the line
	found := r.Scan()
	require.Len(t, found, 2)
	require.Equal(t, "key", found[0].What)
	require.Equal(t, "body", found[1].What)
}

func TestPatternFindsGeneratedKeys(t *testing.T) {
	r := New()
	r.Pattern("key", regexp.MustCompile(`[a-z]-[0-9a-f]{16}`))
	r.Logger().Info("ok", "key", "0123456789abcdef") // a digest: no prefix
	require.Empty(t, r.Scan())
	r.Logger().Info("leak", "err", "claim new-0123456789abcdef")
	require.Len(t, r.Scan(), 1)
}
