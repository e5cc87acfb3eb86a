package main

import (
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"net/http"
	"strings"
)

// The tenant a request acts for comes from authentication, never from a
// header the client chooses: a stored response is handed to anyone who
// presents its tenant and key, so a tenant taken from the request would let
// whoever learns another tenant's key read that tenant's answers (see
// docs/security.md). This file is the smallest honest stand-in for a real
// authentication layer (OAuth, mTLS, an API gateway): bearer tokens of the
// form "<tenant>.<HMAC-SHA256 of the tenant>", signed with -token-secret.

// principal is the authenticated caller.
type principal struct {
	Tenant string
}

type principalKey struct{}

// principalOf returns the principal authenticate put in ctx.
func principalOf(ctx context.Context) (principal, bool) {
	p, ok := ctx.Value(principalKey{}).(principal)
	return p, ok
}

// authenticator checks bearer tokens.
type authenticator struct {
	secret []byte
}

// newAuthenticator signs with secret, or with a random secret when it is
// empty (tokens then last as long as the process).
func newAuthenticator(secret string) *authenticator {
	key := []byte(secret)
	if secret == "" {
		key = make([]byte, 32)
		_, _ = rand.Read(key)
	}
	return &authenticator{secret: key}
}

// token returns the bearer token of tenant.
func (a *authenticator) token(tenant string) string {
	return tenant + "." + a.sign(tenant)
}

func (a *authenticator) sign(tenant string) string {
	m := hmac.New(sha256.New, a.secret)
	m.Write([]byte(tenant))
	return hex.EncodeToString(m.Sum(nil))
}

// middleware authenticates every request before anything else runs (the
// idempotency middleware included, whose Config.Tenant reads the principal)
// and answers 401 without a valid token.
func (a *authenticator) middleware(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tenant, ok := a.tenantOf(r)
		if !ok {
			w.Header().Set("WWW-Authenticate", `Bearer realm="orders"`)
			writeError(w, r, http.StatusUnauthorized, "unauthenticated", "Send Authorization: Bearer <token>.")
			return
		}
		next.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), principalKey{}, principal{Tenant: tenant})))
	})
}

// tenantOf returns the tenant of r's valid bearer token.
func (a *authenticator) tenantOf(r *http.Request) (string, bool) {
	if tok, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer "); ok {
		tenant, sig, ok := strings.Cut(tok, ".")
		if ok && tenant != "" && hmac.Equal([]byte(sig), []byte(a.sign(tenant))) {
			return tenant, true
		}
	}
	return "", false
}
