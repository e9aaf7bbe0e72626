// Command crdcheck validates CustomResourceDefinition files as the API server does when one is
// created: structural schema, defaults, CEL rules and message expressions compiled, and their
// estimated cost held to the per-rule and whole-schema budgets. It prints each violation, or
// "ok", and exits 1 on any. Built by tests/cluster/build-crdcheck; run by
// tests/unit/test_crd_server_validation.py, so a rule the server would refuse fails without a cluster.
package main

import (
	"context"
	"fmt"
	"os"

	"k8s.io/apiextensions-apiserver/pkg/apis/apiextensions"
	apiextv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	"k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/validation"
	"sigs.k8s.io/yaml"
)

func check(path string) (int, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	var v1 apiextv1.CustomResourceDefinition
	if err := yaml.UnmarshalStrict(data, &v1); err != nil {
		return 0, fmt.Errorf("%s: %w", path, err)
	}
	apiextv1.SetObjectDefaults_CustomResourceDefinition(&v1)
	var crd apiextensions.CustomResourceDefinition
	if err := apiextv1.Convert_v1_CustomResourceDefinition_To_apiextensions_CustomResourceDefinition(&v1, &crd, nil); err != nil {
		return 0, fmt.Errorf("%s: %w", path, err)
	}
	errs := validation.ValidateCustomResourceDefinition(context.Background(), &crd)
	for _, e := range errs {
		fmt.Printf("%s: %s\n", path, e.Error())
	}
	return len(errs), nil
}

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: crdcheck CRD.yaml...")
		os.Exit(2)
	}
	bad := 0
	for _, path := range os.Args[1:] {
		n, err := check(path)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
		bad += n
	}
	if bad > 0 {
		os.Exit(1)
	}
	fmt.Println("ok")
}
