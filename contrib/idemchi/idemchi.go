// Package idemchi names idemhttp's operations after chi routes.
//
// idemhttp's default operation is the method and r.Pattern, which chi sets
// only once it has routed the request: a middleware on the router
// (r.Use) runs before that and sees no pattern, and one inside r.Route
// (r.Route("/v1", func(r chi.Router) { r.Use(mw.Wrap); ... })) sees the
// mount pattern "/v1/*". idemhttp never takes a catch-all pattern for an
// operation (it uses the request path instead, see idemhttp.RouteOperation),
// so no two routes share a scope either way; [Operation] gives the route's
// own pattern, "POST /v1/orders/{id}/items", in every layout, so that one
// route is one operation whatever its path parameters:
//
//	mw, err := idemhttp.New(store, &idemhttp.Config{
//		Operation: idemchi.Operation,
//		RequestID: idemchi.RequestID, // chi's middleware.RequestID, when it runs first
//	})
//	r := chi.NewRouter()
//	r.Use(middleware.RequestID)
//	r.Route("/v1", func(r chi.Router) {
//		r.Use(mw.Wrap)
//		r.Post("/orders", createOrder)
//	})
package idemchi

import (
	"errors"
	"net/http"

	"github.com/go-chi/chi/v5"
	"github.com/go-chi/chi/v5/middleware"

	"github.com/idemstore/idem/idemhttp"
)

// ErrNoRouteContext is Operation's error for a request that is not served
// by a chi router: the middleware is wired outside chi.
var ErrNoRouteContext = errors.New("idemchi: the request has no chi route context")

// Operation is an idemhttp Config.Operation for chi: the method and the
// pattern of the chi route that serves r, looked up from the top router in
// r's chi.RouteContext (the same search chi's routing does, on a fresh
// context, so the request's own routing state is untouched). It works
// before routing (r.Use on the router), in a subrouter (r.Route, r.Mount,
// r.Group) and on a route (r.With). A route found nowhere, or whose pattern
// still matches many routes (a handler mounted at "/files/*" that is not a
// chi router), is named by its path, as idemhttp.RouteOperation does. A
// request outside chi gets ErrNoRouteContext, which idemhttp answers with
// 500 idempotency_operation_failed without running the handler.
func Operation(r *http.Request) (string, error) {
	rctx := chi.RouteContext(r.Context())
	if rctx == nil || rctx.Routes == nil {
		return "", ErrNoRouteContext
	}
	path := r.URL.RawPath
	if path == "" {
		path = r.URL.Path
	}
	if path == "" {
		path = "/"
	}
	return idemhttp.RouteOperation(r, rctx.Routes.Find(chi.NewRouteContext(), r.Method, path)), nil
}

// RequestID is an idemhttp Config.RequestID that takes the ID chi's
// middleware.RequestID put in the context (which honours the incoming
// X-Request-Id), so that chi's logs and idemhttp's answers and logs carry
// the same ID. idemhttp generates one when it is missing or not well formed.
func RequestID(r *http.Request) string {
	return middleware.GetReqID(r.Context())
}
