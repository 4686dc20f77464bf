// The test cluster's custom metrics API (custom.metrics.k8s.io), built on
// sigs.k8s.io/custom-metrics-apiserver: each pod's metric is what Prometheus holds for it,
// averaged over its series (`avg by (pod) (METRIC{namespace="NS"})`), so an HPA on
// DCGM_FI_DEV_GPU_UTIL reads what dcgm-exporter (or gpuflow's samples under its names)
// wrote. A real cluster runs prometheus-adapter with infra/prometheus/adapter-rules.yaml
// for the same API; this stands in for it where that module cannot be fetched.
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"strings"
	"time"

	apierr "k8s.io/apimachinery/pkg/api/errors"
	apimeta "k8s.io/apimachinery/pkg/api/meta"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/dynamic"
	"k8s.io/component-base/logs"
	"k8s.io/klog/v2"
	"k8s.io/metrics/pkg/apis/custom_metrics"
	"k8s.io/metrics/pkg/apis/external_metrics"

	basecmd "sigs.k8s.io/custom-metrics-apiserver/pkg/cmd"
	"sigs.k8s.io/custom-metrics-apiserver/pkg/provider"
	"sigs.k8s.io/custom-metrics-apiserver/pkg/provider/helpers"
)

type prometheusProvider struct {
	client     dynamic.Interface
	mapper     apimeta.RESTMapper
	prometheus string
	metrics    []string
}

// podValues returns each pod's value of `metric` in `namespace`, as Prometheus holds it now.
func (p *prometheusProvider) podValues(ctx context.Context, namespace, metric string) (map[string]float64, error) {
	query := fmt.Sprintf(`avg by (pod) (%s{namespace=%q})`, metric, namespace)
	request, err := http.NewRequestWithContext(ctx, http.MethodGet,
		p.prometheus+"/api/v1/query?query="+url.QueryEscape(query), nil)
	if err != nil {
		return nil, err
	}
	response, err := http.DefaultClient.Do(request)
	if err != nil {
		return nil, fmt.Errorf("prometheus at %s: %w", p.prometheus, err)
	}
	defer response.Body.Close()
	var answer struct {
		Status string `json:"status"`
		Data   struct {
			Result []struct {
				Metric map[string]string `json:"metric"`
				Value  []any             `json:"value"`
			} `json:"result"`
		} `json:"data"`
	}
	if err := json.NewDecoder(response.Body).Decode(&answer); err != nil {
		return nil, err
	}
	values := map[string]float64{}
	for _, series := range answer.Data.Result {
		if len(series.Value) != 2 {
			continue
		}
		text, _ := series.Value[1].(string)
		if value, err := strconv.ParseFloat(text, 64); err == nil {
			values[series.Metric["pod"]] = value
		}
	}
	return values, nil
}

func (p *prometheusProvider) value(name types.NamespacedName, info provider.CustomMetricInfo, value float64) (*custom_metrics.MetricValue, error) {
	ref, err := helpers.ReferenceFor(p.mapper, name, info)
	if err != nil {
		return nil, err
	}
	return &custom_metrics.MetricValue{
		DescribedObject: ref,
		Metric:          custom_metrics.MetricIdentifier{Name: info.Metric},
		Timestamp:       metav1.Time{Time: time.Now()},
		Value:           *resource.NewMilliQuantity(int64(value*1000), resource.DecimalSI),
	}, nil
}

func (p *prometheusProvider) GetMetricByName(ctx context.Context, name types.NamespacedName, info provider.CustomMetricInfo, _ labels.Selector) (*custom_metrics.MetricValue, error) {
	values, err := p.podValues(ctx, name.Namespace, info.Metric)
	if err != nil {
		return nil, apierr.NewServiceUnavailable(err.Error())
	}
	value, found := values[name.Name]
	if !found {
		return nil, provider.NewMetricNotFoundForError(info.GroupResource, info.Metric, name.Name)
	}
	return p.value(name, info, value)
}

func (p *prometheusProvider) GetMetricBySelector(ctx context.Context, namespace string, selector labels.Selector, info provider.CustomMetricInfo, _ labels.Selector) (*custom_metrics.MetricValueList, error) {
	names, err := helpers.ListObjectNames(p.mapper, p.client, namespace, selector, info)
	if err != nil {
		return nil, err
	}
	values, err := p.podValues(ctx, namespace, info.Metric)
	if err != nil {
		return nil, apierr.NewServiceUnavailable(err.Error())
	}
	list := &custom_metrics.MetricValueList{}
	for _, name := range names {
		if value, found := values[name]; found {
			metric, err := p.value(types.NamespacedName{Namespace: namespace, Name: name}, info, value)
			if err != nil {
				return nil, err
			}
			list.Items = append(list.Items, *metric)
		}
	}
	return list, nil
}

func (p *prometheusProvider) ListAllMetrics() []provider.CustomMetricInfo {
	infos := []provider.CustomMetricInfo{}
	for _, metric := range p.metrics {
		infos = append(infos, provider.CustomMetricInfo{
			GroupResource: schema.GroupResource{Resource: "pods"}, Namespaced: true, Metric: metric,
		})
	}
	return infos
}

func (p *prometheusProvider) GetExternalMetric(context.Context, string, labels.Selector, provider.ExternalMetricInfo) (*external_metrics.ExternalMetricValueList, error) {
	return &external_metrics.ExternalMetricValueList{}, nil
}

func (p *prometheusProvider) ListAllExternalMetrics() []provider.ExternalMetricInfo {
	return nil
}

type adapter struct {
	basecmd.AdapterBase
	prometheus string
	metrics    string
}

func main() {
	logs.InitLogs()
	defer logs.FlushLogs()
	cmd := &adapter{}
	cmd.Name = "gpuflow-metrics-adapter"
	cmd.Flags().StringVar(&cmd.prometheus, "prometheus-url", "http://127.0.0.1:9090", "Prometheus to query")
	cmd.Flags().StringVar(&cmd.metrics, "metrics", "DCGM_FI_DEV_GPU_UTIL", "pod metrics served, comma-separated")
	logs.AddFlags(cmd.Flags())
	if err := cmd.Flags().Parse(os.Args); err != nil {
		klog.Fatalf("unable to parse flags: %v", err)
	}
	client, err := cmd.DynamicClient()
	if err != nil {
		klog.Fatalf("unable to construct dynamic client: %v", err)
	}
	mapper, err := cmd.RESTMapper()
	if err != nil {
		klog.Fatalf("unable to construct discovery REST mapper: %v", err)
	}
	served := &prometheusProvider{client: client, mapper: mapper,
		prometheus: strings.TrimRight(cmd.prometheus, "/"), metrics: strings.Split(cmd.metrics, ",")}
	cmd.WithCustomMetrics(served)
	cmd.WithExternalMetrics(served)
	if err := cmd.Run(context.Background()); err != nil {
		klog.Fatalf("unable to run the custom metrics adapter: %v", err)
	}
}
