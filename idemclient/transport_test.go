package idemclient_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idemstore/idem/idemclient"
)

// seen is what the test server received on one attempt.
type seen struct {
	method, key, body string
}

// scripted is a test server that answers attempt i with script[i] (the last
// entry for every attempt after), and records every attempt.
type scripted struct {
	t      *testing.T
	srv    *httptest.Server
	script []func(w http.ResponseWriter, r *http.Request)

	mu       sync.Mutex
	attempts []seen
}

func newScripted(t *testing.T, script ...func(w http.ResponseWriter, r *http.Request)) *scripted {
	t.Helper()
	s := &scripted{t: t, script: script}
	s.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(r.Body)
		assert.NoError(t, err)
		s.mu.Lock()
		n := len(s.attempts)
		s.attempts = append(s.attempts, seen{method: r.Method, key: r.Header.Get("Idempotency-Key"), body: string(body)})
		s.mu.Unlock()
		s.script[min(n, len(s.script)-1)](w, r)
	}))
	t.Cleanup(s.srv.Close)
	return s
}

func (s *scripted) seen() []seen {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]seen(nil), s.attempts...)
}

// status answers code with an idemhttp-shaped error body when code is set.
func status(code int, errCode string, header ...string) func(w http.ResponseWriter, r *http.Request) {
	return func(w http.ResponseWriter, _ *http.Request) {
		for i := 0; i+1 < len(header); i += 2 {
			w.Header().Set(header[i], header[i+1])
		}
		if errCode == "" {
			w.WriteHeader(code)
			_, _ = fmt.Fprintf(w, "status %d", code)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(code)
		_, _ = fmt.Fprintf(w, `{"code":%q,"message":"…","request_id":"req_1"}`, errCode)
	}
}

var created = func(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	_, _ = io.WriteString(w, `{"id":1}`)
}

// fast is a Transport configuration whose backoff costs the tests nothing.
func fast(t *testing.T, cfg idemclient.Config) *http.Client {
	t.Helper()
	if cfg.MinBackoff == 0 {
		cfg.MinBackoff = time.Millisecond
		cfg.MaxBackoff = 5 * time.Millisecond
	}
	tr, err := idemclient.New(&cfg)
	require.NoError(t, err)
	return &http.Client{Transport: tr}
}

func post(t *testing.T, c *http.Client, ctx context.Context, url, body string) (*http.Response, string, error) {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
	require.NoError(t, err)
	resp, err := c.Do(req)
	if err != nil {
		return nil, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp, string(b), nil
}

var uuidV4 = regexp.MustCompile(`^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$`)

// TestRetryableClasses: every retryable answer is retried, with the same key
// and body, until the server answers 201.
func TestRetryableClasses(t *testing.T) {
	t.Parallel()
	for name, first := range map[string]func(http.ResponseWriter, *http.Request){
		"408":                                 status(http.StatusRequestTimeout, ""),
		"409 idempotency_request_in_progress": status(http.StatusConflict, "idempotency_request_in_progress"),
		"409 in progress, +json media type": func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "application/problem+json; charset=utf-8")
			w.WriteHeader(http.StatusConflict)
			_, _ = io.WriteString(w, `{"type":"about:blank","code":"idempotency_request_in_progress"}`)
		},
		"425":                           status(http.StatusTooEarly, ""),
		"429":                           status(http.StatusTooManyRequests, ""),
		"500 from the handler":          status(http.StatusInternalServerError, ""),
		"500 with another code":         status(http.StatusInternalServerError, "internal_error"),
		"502":                           status(http.StatusBadGateway, ""),
		"503 idempotency_store_unavail": status(http.StatusServiceUnavailable, "idempotency_store_unavailable"),
		"503 idempotency_lease_lost":    status(http.StatusServiceUnavailable, "idempotency_lease_lost"),
		"504":                           status(http.StatusGatewayTimeout, ""),
		"connection closed without an answer": func(w http.ResponseWriter, _ *http.Request) {
			conn, _, err := http.NewResponseController(w).Hijack()
			if assert.NoError(t, err) {
				_ = conn.Close()
			}
		},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			s := newScripted(t, first, first, created)
			resp, body, err := post(t, fast(t, idemclient.Config{}), t.Context(), s.srv.URL, `{"sku":"tea"}`)
			require.NoError(t, err)
			require.Equal(t, http.StatusCreated, resp.StatusCode)
			require.Equal(t, `{"id":1}`, body)
			got := s.seen()
			require.Len(t, got, 3)
			require.Regexp(t, uuidV4, got[0].key, "a generated key")
			for _, a := range got {
				require.Equal(t, seen{method: http.MethodPost, key: got[0].key, body: `{"sku":"tea"}`}, a, "the same key and body on every attempt")
			}
			require.Equal(t, got[0].key, resp.Request.Header.Get("Idempotency-Key"), "the response names the key sent")
		})
	}
}

// TestFinalClasses: answers a retry cannot change are returned after one
// attempt, body intact.
func TestFinalClasses(t *testing.T) {
	t.Parallel()
	for name, c := range map[string]struct {
		status int
		code   string
	}{
		"400 idempotency_key_invalid":        {http.StatusBadRequest, "idempotency_key_invalid"},
		"400 plain":                          {http.StatusBadRequest, ""},
		"404":                                {http.StatusNotFound, ""},
		"409 idempotency_key_reused":         {http.StatusConflict, "idempotency_key_reused"},
		"409 of the handler":                 {http.StatusConflict, "sku_sold_out"},
		"409 without a JSON body":            {http.StatusConflict, ""},
		"413 idempotency_body_too_large":     {http.StatusRequestEntityTooLarge, "idempotency_body_too_large"},
		"422 idempotency_key_reused (IETF)":  {http.StatusUnprocessableEntity, "idempotency_key_reused"},
		"422 validation":                     {http.StatusUnprocessableEntity, "validation_failed"},
		"500 idempotency_response_too_large": {http.StatusInternalServerError, "idempotency_response_too_large"},
		"501":                                {http.StatusNotImplemented, ""},
		"200":                                {http.StatusOK, ""},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			s := newScripted(t, status(c.status, c.code), created)
			resp, body, err := post(t, fast(t, idemclient.Config{}), t.Context(), s.srv.URL, `{}`)
			require.NoError(t, err)
			require.Equal(t, c.status, resp.StatusCode)
			if c.code != "" {
				require.JSONEq(t, fmt.Sprintf(`{"code":%q,"message":"…","request_id":"req_1"}`, c.code), body, "the body read to classify it is whole")
			} else {
				require.Equal(t, fmt.Sprintf("status %d", c.status), body)
			}
			require.Len(t, s.seen(), 1)
		})
	}
}

func TestRetryAfter(t *testing.T) {
	t.Parallel()
	t.Run("honoured", func(t *testing.T) {
		t.Parallel()
		s := newScripted(t, status(http.StatusConflict, "idempotency_request_in_progress", "Retry-After", "1"), created)
		start := time.Now()
		resp, _, err := post(t, fast(t, idemclient.Config{}), t.Context(), s.srv.URL, `{}`)
		require.NoError(t, err)
		require.Equal(t, http.StatusCreated, resp.StatusCode)
		require.GreaterOrEqual(t, time.Since(start), time.Second, "not before Retry-After")
		require.Less(t, time.Since(start), 3*time.Second)
	})
	t.Run("an HTTP date", func(t *testing.T) {
		t.Parallel()
		s := newScripted(t, func(w http.ResponseWriter, r *http.Request) {
			status(http.StatusServiceUnavailable, "", "Retry-After", time.Now().Add(2*time.Second).UTC().Format(http.TimeFormat))(w, r)
		}, created)
		start := time.Now()
		resp, _, err := post(t, fast(t, idemclient.Config{}), t.Context(), s.srv.URL, `{}`)
		require.NoError(t, err)
		require.Equal(t, http.StatusCreated, resp.StatusCode)
		require.GreaterOrEqual(t, time.Since(start), 900*time.Millisecond, "the date is whole seconds: at least 1s ahead")
	})
	t.Run("capped", func(t *testing.T) {
		t.Parallel()
		s := newScripted(t, status(http.StatusTooManyRequests, "", "Retry-After", "3600"), created)
		start := time.Now()
		resp, _, err := post(t, fast(t, idemclient.Config{MaxRetryAfter: 200 * time.Millisecond}), t.Context(), s.srv.URL, `{}`)
		require.NoError(t, err)
		require.Equal(t, http.StatusCreated, resp.StatusCode)
		require.GreaterOrEqual(t, time.Since(start), 200*time.Millisecond)
		require.Less(t, time.Since(start), 2*time.Second, "MaxRetryAfter, not the hour asked for")
	})
	t.Run("beyond the deadline", func(t *testing.T) {
		t.Parallel()
		// The wait would outlast the caller's deadline: the 409 in hand
		// is returned at once, readable, instead of a deadline error.
		s := newScripted(t, status(http.StatusConflict, "idempotency_request_in_progress", "Retry-After", "5"))
		ctx, cancel := context.WithTimeout(t.Context(), 2*time.Second)
		defer cancel()
		start := time.Now()
		resp, body, err := post(t, fast(t, idemclient.Config{}), ctx, s.srv.URL, `{}`)
		require.NoError(t, err)
		require.Equal(t, http.StatusConflict, resp.StatusCode)
		require.Contains(t, body, "idempotency_request_in_progress")
		require.Less(t, time.Since(start), time.Second)
		require.Len(t, s.seen(), 1)
	})
}

func TestRetryAfterParse(t *testing.T) {
	t.Parallel()
	now := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	for v, want := range map[string]time.Duration{
		"0": 0, "1": time.Second, " 30 ": 30 * time.Second,
		now.Add(90 * time.Second).Format(http.TimeFormat): 90 * time.Second,
		now.Add(-time.Hour).Format(http.TimeFormat):       0,
	} {
		got, ok := idemclient.RetryAfter(&http.Response{Header: http.Header{"Retry-After": {v}}}, now)
		require.True(t, ok, v)
		require.Equal(t, want, got, v)
	}
	for _, v := range []string{"", "-1", "1.5", "soon", "99999999999"} {
		_, ok := idemclient.RetryAfter(&http.Response{Header: http.Header{"Retry-After": {v}}}, now)
		require.False(t, ok, v)
	}
	_, ok := idemclient.RetryAfter(nil, now)
	require.False(t, ok)
}

// TestAttemptTimeout: an attempt that gets no answer in time is abandoned
// and retried with the same key; the server's late answer is not mixed in.
func TestAttemptTimeout(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	s := newScripted(t, func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-release:
		case <-r.Context().Done():
		}
		status(http.StatusTeapot, "")(w, r)
	}, created)
	defer close(release)
	resp, body, err := post(t, fast(t, idemclient.Config{AttemptTimeout: 200 * time.Millisecond}), t.Context(), s.srv.URL, `{"a":1}`)
	require.NoError(t, err)
	require.Equal(t, http.StatusCreated, resp.StatusCode, body)
	got := s.seen()
	require.Len(t, got, 2)
	require.Equal(t, got[0], got[1])
}

// TestMaxAttempts: an answer that stays retryable is returned after
// MaxAttempts attempts; an error is returned wrapped.
func TestMaxAttempts(t *testing.T) {
	t.Parallel()
	s := newScripted(t, status(http.StatusServiceUnavailable, "idempotency_store_unavailable"))
	resp, body, err := post(t, fast(t, idemclient.Config{MaxAttempts: 4}), t.Context(), s.srv.URL, `{}`)
	require.NoError(t, err)
	require.Equal(t, http.StatusServiceUnavailable, resp.StatusCode)
	require.Contains(t, body, "idempotency_store_unavailable")
	require.Len(t, s.seen(), 4)

	// Nothing listens: every attempt is refused.
	dead := httptest.NewServer(http.NotFoundHandler())
	url := dead.URL
	dead.Close()
	_, _, err = post(t, fast(t, idemclient.Config{MaxAttempts: 3}), t.Context(), url, `{}`)
	require.ErrorContains(t, err, "attempt 3 of 3")
	require.ErrorContains(t, err, "connection refused")
}

// TestKeys: the caller's key (header or context) is used on every attempt;
// otherwise each logical request gets a new one.
func TestKeys(t *testing.T) {
	t.Parallel()
	s := newScripted(t, status(http.StatusBadGateway, ""), created)
	c := fast(t, idemclient.Config{})

	req, err := http.NewRequestWithContext(idemclient.WithKey(t.Context(), "from-the-context-1"), http.MethodPost, s.srv.URL, strings.NewReader("x"))
	require.NoError(t, err)
	req.Header.Set("Idempotency-Key", "from-the-header-1")
	resp, err := c.Do(req)
	require.NoError(t, err)
	resp.Body.Close()
	require.Empty(t, req.Header.Get("X-Unrelated"))
	require.Equal(t, "from-the-header-1", req.Header.Get("Idempotency-Key"), "the caller's request is not modified")

	req, err = http.NewRequestWithContext(idemclient.WithKey(t.Context(), "from-the-context-1"), http.MethodPatch, s.srv.URL, strings.NewReader("x"))
	require.NoError(t, err)
	resp, err = c.Do(req)
	require.NoError(t, err)
	resp.Body.Close()
	require.Empty(t, req.Header.Get("Idempotency-Key"), "the caller's request is not modified")

	for range 2 {
		_, _, err = post(t, c, t.Context(), s.srv.URL, "x")
		require.NoError(t, err)
	}
	got := s.seen()
	require.Len(t, got, 5)
	require.Equal(t, "from-the-header-1", got[0].key)
	require.Equal(t, "from-the-header-1", got[1].key, "retried with the same key")
	require.Equal(t, "from-the-context-1", got[2].key)
	require.Regexp(t, uuidV4, got[3].key)
	require.Regexp(t, uuidV4, got[4].key)
	require.NotEqual(t, got[3].key, got[4].key, "two logical requests, two keys")
	require.Regexp(t, `^[A-Za-z0-9_-]{12,64}$`, got[3].key, "idemhttp's default key format")

	custom := fast(t, idemclient.Config{Header: "Idem-Key", NewKey: func() (string, error) { return "", errors.New("no entropy") }})
	_, _, err = post(t, custom, t.Context(), s.srv.URL, "x")
	require.ErrorContains(t, err, "no entropy")
}

// TestOtherMethods: a GET is sent once, without a key, whatever it gets.
func TestOtherMethods(t *testing.T) {
	t.Parallel()
	s := newScripted(t, status(http.StatusServiceUnavailable, ""), created)
	resp, err := fast(t, idemclient.Config{}).Get(s.srv.URL)
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusServiceUnavailable, resp.StatusCode)
	require.Equal(t, []seen{{method: http.MethodGet}}, s.seen())
}

// onlyReader hides bytes.Reader's type, so that http.NewRequest sets no
// GetBody.
type onlyReader struct{ io.Reader }

// TestBodyWithoutGetBody: a body the request cannot rewind is read once and
// sent whole on every attempt.
func TestBodyWithoutGetBody(t *testing.T) {
	t.Parallel()
	s := newScripted(t, status(http.StatusBadGateway, ""), status(http.StatusBadGateway, ""), created)
	req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, s.srv.URL, onlyReader{strings.NewReader(`{"big":"body"}`)})
	require.NoError(t, err)
	require.Nil(t, req.GetBody)
	resp, err := fast(t, idemclient.Config{}).Do(req)
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusCreated, resp.StatusCode)
	for _, a := range s.seen() {
		require.Equal(t, `{"big":"body"}`, a.body)
	}
}

// TestCancelWhileWaiting: a context cancelled during the backoff ends the
// exchange with its cause.
func TestCancelWhileWaiting(t *testing.T) {
	t.Parallel()
	s := newScripted(t, status(http.StatusServiceUnavailable, "", "Retry-After", "5"))
	ctx, cancel := context.WithCancelCause(t.Context())
	stop := errors.New("the user gave up")
	time.AfterFunc(200*time.Millisecond, func() { cancel(stop) })
	start := time.Now()
	_, _, err := post(t, fast(t, idemclient.Config{}), ctx, s.srv.URL, `{}`)
	require.ErrorIs(t, err, stop)
	require.Less(t, time.Since(start), 2*time.Second)
	require.Len(t, s.seen(), 1)
}

func TestNewRefuses(t *testing.T) {
	t.Parallel()
	for _, cfg := range []idemclient.Config{
		{MaxAttempts: -1},
		{AttemptTimeout: -time.Second},
		{MinBackoff: -time.Second},
		{MinBackoff: time.Second, MaxBackoff: time.Millisecond},
		{MaxRetryAfter: -time.Second},
		{Header: "Idempotency Key"},
		{Header: "Key:"},
	} {
		_, err := idemclient.New(&cfg)
		require.Error(t, err, "%+v", cfg)
	}
	_, err := idemclient.New(nil)
	require.NoError(t, err)
}

func TestBackoff(t *testing.T) {
	t.Parallel()
	for n, ceil := range map[int]time.Duration{1: 100 * time.Millisecond, 2: 200 * time.Millisecond, 4: 800 * time.Millisecond, 10: time.Second, 1000: time.Second} {
		for range 50 {
			d := idemclient.Backoff(100*time.Millisecond, time.Second, n)
			require.GreaterOrEqual(t, d, ceil/2, n)
			require.LessOrEqual(t, d, ceil, n)
		}
	}
}

func TestRetryableErrors(t *testing.T) {
	t.Parallel()
	for err, want := range map[error]bool{
		errors.New("read tcp: connection reset by peer"): true,
		io.ErrUnexpectedEOF: true,
		fmt.Errorf("Client.Timeout exceeded: %w", context.DeadlineExceeded):      true,
		fmt.Errorf("Post: %w", context.Canceled):                                 false,
		fmt.Errorf("tls: %w", x509.UnknownAuthorityError{}):                      false,
		fmt.Errorf("tls: %w", &tls.CertificateVerificationError{Err: io.EOF}):    false,
		errors.New(`Post "ftp://x": unsupported protocol scheme "ftp"`):          false,
		errors.New(`net/http: invalid header field value for "Idempotency-Key"`): false,
	} {
		require.Equal(t, want, idemclient.Retryable(nil, err), err.Error())
	}
	require.False(t, idemclient.Retryable(nil, nil), "no response, no error")
}

// TestBaseTransportTimeout: a timeout of the base transport's own
// (ResponseHeaderTimeout here) is retried like an attempt timeout.
func TestBaseTransportTimeout(t *testing.T) {
	t.Parallel()
	s := newScripted(t, func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-time.After(2 * time.Second):
		case <-r.Context().Done():
		}
	}, created)
	base := http.DefaultTransport.(*http.Transport).Clone()
	base.ResponseHeaderTimeout = 200 * time.Millisecond
	t.Cleanup(base.CloseIdleConnections)
	resp, _, err := post(t, fast(t, idemclient.Config{Base: base}), t.Context(), s.srv.URL, `{}`)
	require.NoError(t, err)
	require.Equal(t, http.StatusCreated, resp.StatusCode)
	require.Len(t, s.seen(), 2)
}
