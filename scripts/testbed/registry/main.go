// A local OCI registry for the tests (scripts/registry.sh): go-containerregistry's
// in-memory registry on loopback, with the repositories under -private behind HTTP basic
// auth (the user and password read from the file -auth names, "user:password"), answered
// the way registries answer: 401 with a Basic challenge, then the request.
package main

import (
	"crypto/subtle"
	"flag"
	"fmt"
	"log"
	"net"
	"net/http"
	"os"
	"strings"

	"github.com/google/go-containerregistry/pkg/registry"
)

func main() {
	listen := flag.String("listen", "127.0.0.1:0", "address to listen on")
	private := flag.String("private", "private/", "repositories under this prefix need auth")
	authFile := flag.String("auth", "", "file holding user:password for the private repositories")
	portFile := flag.String("port-file", "", "write the port here once listening")
	flag.Parse()
	user, password := "", ""
	if *authFile != "" {
		raw, err := os.ReadFile(*authFile)
		if err != nil {
			log.Fatalf("registry: %v", err)
		}
		parts := strings.SplitN(strings.TrimSpace(string(raw)), ":", 2)
		if len(parts) != 2 {
			log.Fatalf("registry: %s must hold user:password", *authFile)
		}
		user, password = parts[0], parts[1]
	}
	inner := registry.New(registry.Logger(log.New(os.Stderr, "", log.LstdFlags)))
	handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		path := strings.TrimPrefix(r.URL.Path, "/v2/")
		u, p, given := r.BasicAuth()
		given = given && (u != "" || p != "") // an empty pair is how clients go anonymous
		valid := given && subtle.ConstantTimeCompare([]byte(u), []byte(user)) == 1 &&
			subtle.ConstantTimeCompare([]byte(p), []byte(password)) == 1
		// The version check (GET /v2/) challenges, as a registry with auth does, so that
		// clients learn to send credentials; without any, they go on anonymously.
		ping := path == "" && !given
		if user != "" && (ping || (strings.HasPrefix(path, *private) || given) && !valid) {
			w.Header().Set("WWW-Authenticate", `Basic realm="gpuflow-testbed"`)
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusUnauthorized)
			fmt.Fprint(w, `{"errors":[{"code":"UNAUTHORIZED","message":"authentication required"}]}`)
			return
		}
		inner.ServeHTTP(w, r)
	})
	ln, err := net.Listen("tcp", *listen)
	if err != nil {
		log.Fatalf("registry: %v", err)
	}
	if *portFile != "" {
		port := ln.Addr().(*net.TCPAddr).Port
		if err := os.WriteFile(*portFile+".tmp", []byte(fmt.Sprint(port)), 0o644); err != nil {
			log.Fatalf("registry: %v", err)
		}
		if err := os.Rename(*portFile+".tmp", *portFile); err != nil {
			log.Fatalf("registry: %v", err)
		}
	}
	log.Fatal(http.Serve(ln, handler))
}
