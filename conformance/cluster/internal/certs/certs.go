// Package certs generates the small PKI of the local test control plane: one
// CA, serving certificates for the API server and the kubelet, client
// certificates for every component, the service-account signing key pair, and
// kubeconfigs that embed them.
package certs

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"

	"github.com/spf13/cobra"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

// Options selects what to generate.
type Options struct {
	Dir      string
	Server   string
	NodeName string
	// ServiceIP is the first address of the service CIDR (the "kubernetes" Service).
	ServiceIP string
	Validity  time.Duration
}

// NewCommand returns the `certs` subcommand.
func NewCommand() *cobra.Command {
	o := Options{}
	cmd := &cobra.Command{
		Use:          "certs",
		Short:        "Generate CA, component certificates, service-account keys and kubeconfigs",
		SilenceUsage: true,
		Args:         cobra.NoArgs,
		RunE: func(*cobra.Command, []string) error {
			return Generate(o)
		},
	}
	f := cmd.Flags()
	f.StringVar(&o.Dir, "dir", "", "output directory (required); an existing CA and service-account key are reused")
	f.StringVar(&o.Server, "server", "", "API server URL written into kubeconfigs, e.g. https://127.0.0.1:6443 (required)")
	f.StringVar(&o.NodeName, "node-name", "tessera-node", "name of the kubelet's node")
	f.StringVar(&o.ServiceIP, "service-ip", "10.0.0.1", "cluster IP of the kubernetes Service (SAN of the API server)")
	f.DurationVar(&o.Validity, "validity", 365*24*time.Hour, "lifetime of issued certificates")
	_ = cmd.MarkFlagRequired("dir")
	_ = cmd.MarkFlagRequired("server")
	return cmd
}

type keyPair struct {
	cert *x509.Certificate
	key  crypto.Signer
}

// Generate writes the PKI into o.Dir.
func Generate(o Options) error {
	if o.Validity <= 0 {
		return errors.New("validity must be positive")
	}
	if err := os.MkdirAll(o.Dir, 0o700); err != nil {
		return err
	}
	ca, err := loadOrCreateCA(o)
	if err != nil {
		return err
	}
	if err := ensureServiceAccountKey(o.Dir); err != nil {
		return err
	}
	serviceIP := net.ParseIP(o.ServiceIP)
	if serviceIP == nil {
		return fmt.Errorf("invalid --service-ip %q", o.ServiceIP)
	}
	loopback := []net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback}

	leaves := []struct {
		file   string
		cn     string
		orgs   []string
		usage  []x509.ExtKeyUsage
		dns    []string
		ips    []net.IP
		config string // kubeconfig to write for this client identity
	}{
		{file: "apiserver", cn: "kube-apiserver", usage: serverUsage,
			dns: []string{"localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local"},
			ips: append([]net.IP{serviceIP}, loopback...)},
		{file: "kubelet", cn: o.NodeName, usage: serverUsage,
			dns: []string{"localhost", o.NodeName}, ips: loopback},
		{file: "controller-manager-serving", cn: "kube-controller-manager", usage: serverUsage,
			dns: []string{"localhost"}, ips: loopback},
		{file: "scheduler-serving", cn: "kube-scheduler", usage: serverUsage,
			dns: []string{"localhost"}, ips: loopback},
		{file: "admin", cn: "tessera-admin", orgs: []string{"system:masters"}, usage: clientUsage, config: "admin.kubeconfig"},
		{file: "apiserver-kubelet-client", cn: "kube-apiserver-kubelet-client", orgs: []string{"system:masters"}, usage: clientUsage},
		{file: "kubelet-client", cn: "system:node:" + o.NodeName, orgs: []string{"system:nodes"}, usage: clientUsage, config: "kubelet.kubeconfig"},
		{file: "scheduler", cn: "system:kube-scheduler", usage: clientUsage, config: "scheduler.kubeconfig"},
		{file: "controller-manager", cn: "system:kube-controller-manager", usage: clientUsage, config: "controller-manager.kubeconfig"},
	}
	caPEM := encodeCert(ca.cert)
	for _, l := range leaves {
		kp, err := issue(ca, o.Validity, l.cn, l.orgs, l.usage, l.dns, l.ips)
		if err != nil {
			return fmt.Errorf("%s: %w", l.file, err)
		}
		certPEM := encodeCert(kp.cert)
		keyPEM, err := encodeKey(kp.key)
		if err != nil {
			return err
		}
		if err := writeFile(filepath.Join(o.Dir, l.file+".crt"), certPEM, 0o644); err != nil {
			return err
		}
		if err := writeFile(filepath.Join(o.Dir, l.file+".key"), keyPEM, 0o600); err != nil {
			return err
		}
		if l.config != "" {
			if err := writeKubeconfig(filepath.Join(o.Dir, l.config), o.Server, l.cn, caPEM, certPEM, keyPEM); err != nil {
				return err
			}
		}
	}
	return nil
}

var (
	serverUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}
	clientUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}
)

func newKey() (crypto.Signer, error) {
	return ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
}

func serial() (*big.Int, error) {
	return rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 126))
}

func loadOrCreateCA(o Options) (*keyPair, error) {
	certPath, keyPath := filepath.Join(o.Dir, "ca.crt"), filepath.Join(o.Dir, "ca.key")
	if certPEM, err := os.ReadFile(certPath); err == nil {
		keyPEM, err := os.ReadFile(keyPath)
		if err != nil {
			return nil, fmt.Errorf("ca.crt exists but ca.key cannot be read: %w", err)
		}
		cert, err := parseCert(certPEM)
		if err != nil {
			return nil, fmt.Errorf("ca.crt: %w", err)
		}
		key, err := parseKey(keyPEM)
		if err != nil {
			return nil, fmt.Errorf("ca.key: %w", err)
		}
		return &keyPair{cert: cert, key: key}, nil
	} else if !os.IsNotExist(err) {
		return nil, err
	}
	key, err := newKey()
	if err != nil {
		return nil, err
	}
	sn, err := serial()
	if err != nil {
		return nil, err
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber:          sn,
		Subject:               pkix.Name{CommonName: "tessera-test-ca"},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.Add(o.Validity + 24*time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature | x509.KeyUsageCRLSign,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		return nil, err
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	keyPEM, err := encodeKey(key)
	if err != nil {
		return nil, err
	}
	if err := writeFile(keyPath, keyPEM, 0o600); err != nil {
		return nil, err
	}
	if err := writeFile(certPath, encodeCert(cert), 0o644); err != nil {
		return nil, err
	}
	return &keyPair{cert: cert, key: key}, nil
}

func issue(ca *keyPair, validity time.Duration, cn string, orgs []string, usage []x509.ExtKeyUsage, dns []string, ips []net.IP) (*keyPair, error) {
	key, err := newKey()
	if err != nil {
		return nil, err
	}
	sn, err := serial()
	if err != nil {
		return nil, err
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber:          sn,
		Subject:               pkix.Name{CommonName: cn, Organization: orgs},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.Add(validity),
		KeyUsage:              x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment,
		ExtKeyUsage:           usage,
		BasicConstraintsValid: true,
		DNSNames:              dns,
		IPAddresses:           ips,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, key.Public(), ca.key)
	if err != nil {
		return nil, err
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	return &keyPair{cert: cert, key: key}, nil
}

// ensureServiceAccountKey keeps an existing key so that tokens issued before a
// restart stay valid.
func ensureServiceAccountKey(dir string) error {
	keyPath, pubPath := filepath.Join(dir, "sa.key"), filepath.Join(dir, "sa.pub")
	_, errKey := os.Stat(keyPath)
	_, errPub := os.Stat(pubPath)
	if errKey == nil && errPub == nil {
		return nil
	}
	key, err := newKey()
	if err != nil {
		return err
	}
	keyPEM, err := encodeKey(key)
	if err != nil {
		return err
	}
	pubDER, err := x509.MarshalPKIXPublicKey(key.Public())
	if err != nil {
		return err
	}
	if err := writeFile(keyPath, keyPEM, 0o600); err != nil {
		return err
	}
	return writeFile(pubPath, pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: pubDER}), 0o644)
}

func writeKubeconfig(path, server, user string, caPEM, certPEM, keyPEM []byte) error {
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["tessera"] = &clientcmdapi.Cluster{Server: server, CertificateAuthorityData: caPEM}
	cfg.AuthInfos[user] = &clientcmdapi.AuthInfo{ClientCertificateData: certPEM, ClientKeyData: keyPEM}
	cfg.Contexts["tessera"] = &clientcmdapi.Context{Cluster: "tessera", AuthInfo: user, Namespace: "default"}
	cfg.CurrentContext = "tessera"
	data, err := clientcmd.Write(*cfg)
	if err != nil {
		return err
	}
	return writeFile(path, data, 0o600)
}

func encodeCert(c *x509.Certificate) []byte {
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: c.Raw})
}

func encodeKey(k crypto.Signer) ([]byte, error) {
	der, err := x509.MarshalPKCS8PrivateKey(k)
	if err != nil {
		return nil, err
	}
	return pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der}), nil
}

func parseCert(data []byte) (*x509.Certificate, error) {
	b, _ := pem.Decode(data)
	if b == nil || b.Type != "CERTIFICATE" {
		return nil, errors.New("no CERTIFICATE PEM block")
	}
	return x509.ParseCertificate(b.Bytes)
}

func parseKey(data []byte) (crypto.Signer, error) {
	b, _ := pem.Decode(data)
	if b == nil {
		return nil, errors.New("no PEM block")
	}
	k, err := x509.ParsePKCS8PrivateKey(b.Bytes)
	if err != nil {
		return nil, err
	}
	s, ok := k.(crypto.Signer)
	if !ok {
		return nil, fmt.Errorf("unsupported key type %T", k)
	}
	return s, nil
}

// writeFile replaces path atomically so that a component never reads a
// half-written certificate.
func writeFile(path string, data []byte, mode os.FileMode) error {
	tmp, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.Write(data); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Chmod(mode); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), path)
}
